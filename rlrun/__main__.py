from .cli import entry

if __name__ == "__main__":  # not when a spawned process (rollout.pipeline=async) imports it
    entry()
