"""Local checkpoints with replication (spec 002: NVRx's ``nvidia_resiliency_ext.checkpointing.local``).

    from ckpt.local import LocalCheckpointManager, LazyCliqueReplicationStrategy
    mgr = LocalCheckpointManager("/dev/shm/ckpt", repl_strategy=LazyCliqueReplicationStrategy())
    mgr.save({"model": model.state_dict(), "step": step}, iteration=step)
    if mgr.find_latest() >= 0:
        state, ckpt_id = mgr.load()       # a BasicTensorAwareStateDict; state.state_dict is the dict

Names are imported lazily, like ``ckpt``'s.
"""

from __future__ import annotations

from nvrx_common.lazy import lazy_getattr

_EXPORTS = {
    "TensorAwareStateDict": "ckpt.local.base_state_dict",
    "BasicTensorAwareStateDict": "ckpt.local.basic_state_dict",
    "LocalCheckpointManager": "ckpt.local.ckpt_managers.local_manager",
    "LocalSaveRequest": "ckpt.local.ckpt_managers.local_manager",
    "default_root": "ckpt.local.ckpt_managers.local_manager",
    "default_session": "ckpt.local.ckpt_managers.local_manager",
    "ReplicationStrategy": "ckpt.local.replication.strategies",
    "CliqueReplicationStrategy": "ckpt.local.replication.strategies",
    "LazyCliqueReplicationStrategy": "ckpt.local.replication.strategies",
    "LazyReplicationStrategyBuilder": "ckpt.local.replication.strategies",
    "ExchangePlan": "ckpt.local.replication.group_utils",
    "clique_groups": "ckpt.local.replication.group_utils",
    "TwoTierCheckpointer": "ckpt.local.tiers",
    "RestoreResult": "ckpt.local.tiers",
    "NoReplicasAvailableError": "ckpt.local.errors",
    "LocalCheckpointError": "ckpt.local.errors",
    "LocalCheckpointCorruptError": "ckpt.local.errors",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
