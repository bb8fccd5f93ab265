"""TRL's GRPOTrainer trained on polar_gym sessions: any harness, prefix-merged traces, the evaluator's rewards.

The rollout server runs the sessions (``python -m polar_gym.launch`` writes its URL and token to OUT/server.json;
``python -m polar_gym.env serve --info-file fleet.json`` starts a small one); the tasks are TaskRequest JSON lines
(``python -m polar_gym.env request`` turns dataset rows into them). TRL generates nothing itself: each batch's
prompts name tasks, polar_gym runs ``num_generations`` sessions of each through the harness, and TRL trains on the
token ids, masks and logprobs the gateway captured (polar_gym.bridges.trl).

    python examples/trl/grpo_polar.py --fleet OUT/server.json --tasks tasks.jsonl --model Qwen/Qwen3-0.6B \\
        --out trl-run --steps 100 --generations 8

Writes TRL's output folder: trajectories.jsonl (every trace TRL got, with its step) and polar_weights/step-N (the
weights pushed to the fleet before step N+1's sessions; ``--weight-sync none`` pushes nothing).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from polar_gym.bridges.trl import PolarRollout, TRLBridgeSettings, polar_reward
from polar_gym.schema import TaskRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", type=Path, help="the rollout server's {url, admin_token} JSON (server.json); "
                        "default: POLAR_SERVER_URL and POLAR_ADMIN_TOKEN")
    parser.add_argument("--tasks", type=Path, required=True, help="TaskRequest JSON lines")
    parser.add_argument("--model", required=True, help="the policy: a Hugging Face id or folder")
    parser.add_argument("--out", type=Path, required=True, help="TRL's output folder")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--generations", type=int, default=8, help="sessions per task and step (the GRPO group)")
    parser.add_argument("--tasks-per-step", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--weight-sync", choices=["checkpoint", "none"], default="checkpoint")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU, in float32")
    args = parser.parse_args()

    import torch
    from trl import GRPOConfig, GRPOTrainer

    if args.fleet:
        fleet = json.loads(args.fleet.read_text())
        settings = TRLBridgeSettings(server_url=fleet["url"], admin_token=fleet["admin_token"],
                                     weight_sync=args.weight_sync)
    else:
        settings = TRLBridgeSettings.from_env(weight_sync=args.weight_sync)
    tasks = [TaskRequest.model_validate_json(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    rollout = PolarRollout(tasks, settings)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
    config = GRPOConfig(output_dir=str(args.out), max_steps=args.steps, learning_rate=args.lr,
                        num_generations=args.generations,
                        per_device_train_batch_size=args.generations * args.tasks_per_step,
                        logging_steps=1, save_strategy="no", report_to=[], use_cpu=args.cpu, bf16=not args.cpu,
                        model_init_kwargs={"dtype": torch.float32 if args.cpu else torch.bfloat16})
    trainer = GRPOTrainer(model=args.model, reward_funcs=polar_reward, args=config,
                          train_dataset=rollout.dataset(), rollout_func=rollout)
    trainer.train()
    if args.weight_sync == "checkpoint":  # leave the fleet serving the trained weights
        print("final weights:", rollout.sync_weights(trainer))


if __name__ == "__main__":
    main()
