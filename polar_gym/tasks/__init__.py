"""Built-in tasks: the demo task set (tiny git repositories with a failing test and a reference solution), Harbor
task directories read as TaskRequests, and the interpreter of a RuntimeSpec's prepare actions."""

from polar_gym.tasks.demo import DEMO_TASKS, TEST_COMMAND, DemoTask, demo_task, demo_tasks
from polar_gym.tasks.harbor import HarborTask, HarborTaskConfig, find_tasks, load_task
from polar_gym.tasks.prepare import PrepareError, run_prepare

__all__ = ["DEMO_TASKS", "TEST_COMMAND", "DemoTask", "HarborTask", "HarborTaskConfig", "PrepareError", "demo_task",
           "demo_tasks", "find_tasks", "load_task", "run_prepare"]
