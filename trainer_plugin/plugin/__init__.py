"""The in-Trainer plugin: what obd runs inside the job's own process (trainer_plugin/README.md).

The Trainer callback, the patch that adds it to every Trainer with no change to the script
(`sitecustomize.py`, `inject.py`), the helpers for custom training loops, and the job's side of
the run directory's files. Imports the standard library and `trainer_plugin.rundir` only (plus
torch and transformers lazily, when the job already uses them), never the tools beside the job.
Empty on purpose: importing one module of it costs that module alone.
"""
