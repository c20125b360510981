"""Local checkpoints with replication (spec 002: NVRx's ``nvidia_resiliency_ext.checkpointing.local``).

    from nvrx.ckpt.local import LocalCheckpointManager, LazyCliqueReplicationStrategy
    mgr = LocalCheckpointManager("/dev/shm/ckpt", repl_strategy=LazyCliqueReplicationStrategy())
    mgr.save({"model": model.state_dict(), "step": step}, iteration=step)
    if mgr.find_latest() >= 0:
        state, ckpt_id = mgr.load()       # a BasicTensorAwareStateDict; state.state_dict is the dict

Names are imported lazily, like ``nvrx.ckpt``'s.
"""

from __future__ import annotations

from nvrx.common.lazy import lazy_getattr

_EXPORTS = {
    "TensorAwareStateDict": "nvrx.ckpt.local.base_state_dict",
    "BasicTensorAwareStateDict": "nvrx.ckpt.local.basic_state_dict",
    "LocalCheckpointManager": "nvrx.ckpt.local.ckpt_managers.local_manager",
    "LocalSaveRequest": "nvrx.ckpt.local.ckpt_managers.local_manager",
    "default_root": "nvrx.ckpt.local.ckpt_managers.local_manager",
    "default_session": "nvrx.ckpt.local.ckpt_managers.local_manager",
    "ReplicationStrategy": "nvrx.ckpt.local.replication.strategies",
    "CliqueReplicationStrategy": "nvrx.ckpt.local.replication.strategies",
    "LazyCliqueReplicationStrategy": "nvrx.ckpt.local.replication.strategies",
    "LazyReplicationStrategyBuilder": "nvrx.ckpt.local.replication.strategies",
    "ExchangePlan": "nvrx.ckpt.local.replication.group_utils",
    "clique_groups": "nvrx.ckpt.local.replication.group_utils",
    "TwoTierCheckpointer": "nvrx.ckpt.local.tiers",
    "RestoreResult": "nvrx.ckpt.local.tiers",
    "NoReplicasAvailableError": "nvrx.ckpt.local.errors",
    "LocalCheckpointError": "nvrx.ckpt.local.errors",
    "LocalCheckpointCorruptError": "nvrx.ckpt.local.errors",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
