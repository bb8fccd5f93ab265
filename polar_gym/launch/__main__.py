"""``python -m polar_gym.launch``: see polar_gym.launch.main."""

from polar_gym.launch import main

if __name__ == "__main__":
    main()
