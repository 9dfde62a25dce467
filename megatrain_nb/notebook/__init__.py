"""The notebook surface: Session (background training + controls), the live dashboard,
the %megatrain magics and run reports.

Example::

    from megatrain_nb.notebook import Session
    session = Session("tiny"); session.train()
"""
from .magics import load_ipython_extension, unload_ipython_extension
from .session import Session, TrainerLike

__all__ = ["Session", "TrainerLike", "load_ipython_extension", "unload_ipython_extension"]
