"""The job-side tools: what obd runs beside the job on its target, as separate processes.

`jobctl.py` (the control of a run directory: status, cancel, probe, checkpoints),
`supervisor.py` (the job wrapper), `creds.py` (a user's rights), `contain.py` (the run's
processes), `jobserve.py` (the SSH helper), `slurm_batch.py` (obd's side of a Slurm job) and
`watchdog.py` (the pod watchdog). Standard library only, and `trainer_plugin.rundir`; never the
in-Trainer plugin.

They work in two layouts, and import each other accordingly:
- as this package (`from trainer_plugin.tools import jobctl`: the daemon, the executors);
- run by path (`python3 jobctl.py ...`), from a flat copy (SSH hosts' and pods'
  `<workdir>/.obd/tools-<hash>/`, Slurm's `<workdir>/.obd/slurm-<hash>/`: these files with
  `rundir.py` beside them) or from a copy of the package (this folder, or a run's
  `plugin/trainer_plugin/tools/`, with `rundir.py` in the folder above): each file first tries
  the package's relative imports, then puts the folder above its own second on sys.path and
  imports its siblings by bare name, so `rundir` is found beside it or above it.
"""
