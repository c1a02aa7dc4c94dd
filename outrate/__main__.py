"""`python -m outrate`: the CLI. The guard matters: the CPU build of vLLM spawns
its engine process, which re-imports the main module."""

from outrate.cli import main

if __name__ == "__main__":
    main()
