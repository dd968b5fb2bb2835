"""``python -m sgl_kvmap``: the command line (what ``torchrun -m sgl_kvmap`` starts)."""

from .cli import main

if __name__ == "__main__":
    main()
