"""`python -m meshlib_torch plan|run ...` (the torchrun entry point: `torchrun ... -m meshlib_torch run`)."""

from .cli import main

if __name__ == "__main__":
    main()
