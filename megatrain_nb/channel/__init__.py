"""The run-control channel between a training process and the Jupyter server: heartbeat files
and a command inbox in a private folder (``protocol.py``: paths, limits, the inbox's one writer),
the kernel- or rank-side ``beacon.py`` (announces the run, hands its inbox's commands to the run's
``command``), and the server-side reader ``registry.py`` (which runs are alive, enqueue a command,
dismiss an ended run). Below the notebook and the trainer's run control, above nothing but the
shared utilities; ``megatrain_nb.lab`` (the Jupyter server extension) reads it.
"""
