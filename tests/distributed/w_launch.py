"""Worker: ``megatrain_nb.notebook.launch_worker`` as a script (torchrun starts it by path here)."""
import sys

from megatrain_nb.notebook.launch_worker import main

if __name__ == "__main__":
    main(sys.argv[1])
