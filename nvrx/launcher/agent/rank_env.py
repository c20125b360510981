"""The rank environment: what `nvrx launch` gives every rank, key by key (data only, no imports).

torchrun's worker contract plus nvrx's own keys. Two readers hold the launcher to this one list:
tests/integration/test_worker_env.py runs a script under torchrun and under `nvrx launch` and compares the
environments key by key against it, and scripts/gen_docs.py renders it as docs/reference/rank-environment.md.
A key added to the ranks' environment without an entry here fails that test.
"""

from __future__ import annotations

# Keys torchrun 2.13's agent gives each worker (LocalElasticAgent._start_workers, DefaultLogsSpecs.reify,
# launch_agent's TORCHELASTIC_SIGNALS_TO_HANDLE, run.py's OMP_NUM_THREADS), with what nvrx sets them to.
# The test also checks that these are exactly the keys torchrun added, so a new torch variable shows up.
TORCHRUN_KEYS: dict[str, str] = {
    "RANK": "global rank of this process",
    "LOCAL_RANK": "rank on this node (`0` for every rank with `--virtual-local-rank`)",
    "GROUP_RANK": "this node's rank in the rendezvous round",
    "ROLE_RANK": "rank among the ranks with this `--role`",
    "ROLE_NAME": "the `--role` (default `default`)",
    "WORLD_SIZE": "ranks in the job",
    "LOCAL_WORLD_SIZE": "ranks on this node",
    "GROUP_WORLD_SIZE": "nodes in the round",
    "ROLE_WORLD_SIZE": "ranks with this role",
    "MASTER_ADDR": "host of the process-group store, run by group rank 0's agent: `--local-addr`, else that host's "
                   "fully qualified name (`socket.getfqdn()`), as torchrun; where the name does not resolve to the "
                   "one address nvrx binds the store to, the address itself (said in one log line)",
    "MASTER_PORT": "port of that store: a fresh one per round (torchrun reuses its rendezvous store's port)",
    "TORCHELASTIC_USE_AGENT_STORE": "`True`: the agent hosts the store (`False` with a fixed `--master-port`)",
    "TORCHELASTIC_RESTART_COUNT": "restarts so far, counted for the whole job",
    "TORCHELASTIC_MAX_RESTARTS": "the `--max-restarts` value",
    "TORCHELASTIC_RUN_ID": "the `--rdzv-id` (`--standalone`: `standalone-<agent pid>`; torchrun makes up a uuid4)",
    "TORCHELASTIC_ERROR_FILE": "where a rank decorated with torch's `@record` writes its exception: "
                               "`<log dir>/<run id>/errors-<node>-<agent pid>/attempt_<N>/<local rank>/error.json`, "
                               "in a directory only the user can open (0700)",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "the `--signals-to-handle` list (nvrx's default adds `SIGUSR1,SIGUSR2`)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "the agent's value, `1` when unset",
    "OMP_NUM_THREADS": "the agent's value; `1` when unset and `--nproc-per-node` is above 1",
}

# torchrun keys whose values differ between the launchers on purpose (the test checks both are set).
INTENDED_DIFFERENCES: dict[str, str] = {
    "MASTER_PORT": "each launcher picks a free port for its process-group store at run time",
    "TORCHELASTIC_ERROR_FILE": "a path in each launcher's own log directory (torchrun: a mkdtemp; nvrx: private, "
                               "under `<log dir>/<run id>`); both end in `attempt_<restart count>/<local rank>/"
                               "error.json`",
}
# Only under --standalone: both launchers invent the run id; with an explicit --rdzv-id both give that id.
STANDALONE_DIFFERENCES: dict[str, str] = {
    "TORCHELASTIC_RUN_ID": "made up by each launcher under `--standalone` (torchrun: a uuid4, nvrx: "
                           "`standalone-<pid>`)",
}
# nvrx's default --signals-to-handle adds SIGUSR1,SIGUSR2 (graceful stop); with the same flag both agree.
DEFAULT_SIGNALS_DIFFERENCE: dict[str, str] = {
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "nvrx also handles `SIGUSR1,SIGUSR2` by default",
}

# Keys nvrx adds that torchrun does not: its own contract with the rank (value, and when it is set).
NVRX_KEYS: dict[str, str] = {
    "NVRX_MONITOR_SOCKET": "the rank monitor's control socket (a 0600 Unix socket in a 0700 directory)",
    "NVRX_MONITOR_SHM": "the rank's heartbeat slot, shared memory its monitor reads",
    "NVRX_AUTO_HEARTBEAT": "seconds between automatic heartbeats (with `--ft-param-auto-heartbeat true`)",
    "NVRX_ROUND": "the rendezvous round the rank runs in",
    "NVRX_LAUNCH": "the launch: the start time (ns) of the agent that hosts the rendezvous store; with "
                   "`NVRX_ROUND` it orders the job's rounds, so checkpoints of a round the job has left are fenced off",
    "NVRX_RUN_LOG_DIR": "the run's log directory, `<log dir>/<run id>`",
    "NVRX_GRACEFUL_SIGNALS": "the handled signals that stop the job gracefully (read by `job_control.should_stop`)",
    "NVRX_RERUN_EXIT_FILE": "where a rank exiting 16 or 17 names the suspected node (re-run state machine)",
    "NVRX_FULL_EXIT": "`1` with `--no-fast-exit`: ranks run the interpreter's full teardown",
    "NVRX_INPROCESS": "`1` with `--inprocess`",
    "NVRX_INPROCESS_SPARES": "the `--inprocess-spares` count (with `--inprocess`)",
    "NVRX_ASYNC_CKPT": "`1` with `--async-ckpt`",
    "NVRX_JIT_CKPT": "the `--jit-ckpt-timeout` in seconds (with `--jit-ckpt`)",
    "NVRX_LOCAL_CKPT_DIR": "the `--local-ckpt-dir` (read by `nvrx.ckpt.local.default_root()`)",
    "GLOO_SOCKET_IFNAME": "only when the agent has none and this host's name resolves only to a loopback address "
                          "(Debian's `127.0.1.1 <hostname>` line): the interface holding the address this node "
                          "advertises, so gloo listens where the other hosts can reach it",
}

# Keys `nvrx resume` exports to the launches it runs; the agent passes them on to the ranks as inherited.
RESUME_KEYS: dict[str, str] = {
    "FAULT_TOL_FINISHED_FLAG_FILE": "the finished flag `job_control.mark_finished()` writes (default "
                                    "`<state dir>/finished.flag`, unless already set)",
    "NVRX_RESUME_ATTEMPT": "the attempt number over the whole chain (1, 2, ...)",
    "NVRX_RESUME_STATE_DIR": "the `--state-dir` of `nvrx resume`",
}

# Keys nvrx sets for the rank's bootstrap only and removes before user code runs.
REMOVED_BEFORE_USER_CODE: dict[str, str] = {
    "NVRX_MONITOR_TOKEN": "the token that proves to the monitor that the caller is the rank",
}

# What the ranks do not get from nvrx (their value, if any, is inherited from the agent's environment).
NOT_PROVIDED: dict[str, str] = {
    "TORCHELASTIC_ENABLE_FILE_TIMER": "torchrun's file-timer watchdog: not provided (the rank monitors watch ranks "
                                      "instead); `TORCHELASTIC_TIMER_FILE` is passed on only if set",
    "CUDA_VISIBLE_DEVICES": "inherited from the agent (with `--virtual-local-rank`: only the rank's own GPU)",
}
