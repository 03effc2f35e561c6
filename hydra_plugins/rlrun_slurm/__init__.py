"""`hydra/launcher=slurm`: rlrun's SLURM launcher. Hydra's `submitit_slurm` with its options, which submits the jobs
and returns instead of waiting for them; a collect job draws the sweep's comparison when they end (rlrun/cluster/
submit.py, docs/cluster.md). Without the launchers extra (hydra-submitit-launcher) there is no such option."""

from dataclasses import dataclass

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # the launchers extra is not installed
    SlurmLauncher = None

if SlurmLauncher is not None:
    from hydra.core.config_store import ConfigStore

    class RlrunSlurmLauncher(SlurmLauncher):
        def launch(self, job_overrides, initial_job_idx):
            from rlrun.cluster.submit import launch

            return launch(self, job_overrides, initial_job_idx)

    @dataclass
    class RlrunSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.rlrun_slurm.RlrunSlurmLauncher"
        # a SLURM job behind the sweep's jobs runs `python -m rlrun.cluster collect` when they end (false: by hand)
        collect: bool = True

    ConfigStore.instance().store(group="hydra/launcher", name="slurm", node=RlrunSlurmConf(), provider="rlrun")
