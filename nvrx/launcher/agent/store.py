"""Hosting or joining the rendezvous TCPStore that every agent of a job shares.

One agent (the one on the endpoint host, or the only one in --standalone) hosts the store;
everybody else connects as a client. The host writes a few meta keys once so a client can
tell "our rendezvous, same job" from "some other program on that port" and from "a
different job", and fail with one clear line instead of hanging.

Each launch has its own nonce (rdzv_auth.new_launch), drawn by the host and covered by every record's MAC. A
joiner learns it by greeting the host: it pushes a challenge (and its secret's proof, host name and pid) onto a
queue in the store; the host's LaunchGreeter answers with the nonce, signed over that challenge. The nonce begins
with the host's start time, which orders launches for the checkpoint fence (``RendezvousStore.launch``); there is no
unsigned copy of it in the store. An agent whose
secret differs is named on the host at once (one warning line), instead of the host waiting out join_timeout.

Two torch behaviours shape this module:
* a TCPStore client that connects to a listener which never answers blocks forever in its
  handshake, so the handshake runs in a helper thread with a deadline;
* a failing TCPStore connect prints C++ stack traces, so reachability is probed with a
  plain socket first and the store is only built once something accepts connections.
"""

from __future__ import annotations

import datetime
import errno
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable, Mapping

import psutil

import torch.distributed as dist
from torch.distributed import TCPStore

from nvrx.launcher.agent.config import RdzvSettings
from nvrx.common.torch_log import quiet_cpp_warnings
from nvrx.launcher.agent.rdzv_auth import (JOB_WIDE, SECRET_FILE_ENV, RecordAuth, generate_secret, launch_time_ns,
                                            new_launch)
from nvrx.launcher.agent.rdzv_records import BadRecord
from nvrx.common.net import (DEFAULT_OP_TIMEOUT, bind_listen, is_loopback, is_loopback_ip, local_bind_address, resolve,
                             serve_store)
from nvrx.launcher.agent.rdzv_errors import EndpointUnreachable, PortInUse, RendezvousError, RendezvousMismatch

log = logging.getLogger(__name__)

MAGIC_KEY = "nvrx/meta/magic"
MAGIC_VALUE = "nvrx-rendezvous/2"  # /2: records are bound to the launch; joiners greet the host
RUN_ID_KEY = "nvrx/meta/run_id"
NPROC_KEY = "nvrx/meta/nproc_per_node"
AUTH_KEY = "nvrx/meta/auth"  # RecordAuth.proof() of the host: "secret:<hmac>" or "none:<hmac>", never the secret
HELLO_QUEUE = "nvrx/meta/hello"  # joiners push their greeting (JSON); the host's LaunchGreeter pops and answers
LAUNCH_KEY = "nvrx/meta/launch/"  # + the joiner's challenge: the host's signed answer {launch, challenge}
MAX_HELLO_BYTES = 4096
REFUSED_REPORTS = 20  # agents with another secret named per host: a flood of forged greetings cannot fill the log

HANDSHAKE_TIMEOUT = 5.0  # a real store answers in milliseconds; longer means "not a store"
GREETER_WAIT = datetime.timedelta(days=1)  # the greeter's blocking pop; the store wakes it for each greeting
PROBE_TIMEOUT = 1.0  # per plain-socket connect attempt


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---------------------------------------------------------------- addresses


def advertised_address(settings: RdzvSettings, store_host: str, store_port: int) -> str:
    """The address other nodes should use to reach this node: --local-addr, else the route to the store."""
    if settings.local_addr:
        return settings.local_addr
    if is_loopback(store_host) or any(is_loopback_ip(a) for a in resolve(store_host)[:1]):
        return "127.0.0.1"
    targets = resolve(store_host) or [store_host]
    family = socket.AF_INET6 if ":" in targets[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((targets[0], store_port or 9))  # UDP connect sends nothing; it only picks a route
            return probe.getsockname()[0]
    except OSError as exc:
        log.warning("could not find the route to %s (%s); advertising this host's name", store_host, exc)
        return socket.gethostname()


def master_addr_for_ranks(bound_addr: str, local_addr: str | None) -> str:
    """MASTER_ADDR as torchrun sets it (``--local-addr``, else this host's fully qualified name), when it reaches us.

    The process-group store listens on BOUND_ADDR only (never the wildcard), so the host name is used only
    if it resolves to that address; otherwise the address itself, with one log line saying why.
    """
    if local_addr:
        return local_addr
    name = socket.getfqdn()
    if name and bound_addr in resolve(name):
        return name
    log.info("MASTER_ADDR=%s: this host's name %r does not resolve to %s, where the process-group store listens",
             bound_addr, name, bound_addr)
    return bound_addr


def rank_network_env(advertised: str, base_env: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for the ranks when gloo would otherwise pick an address the other hosts cannot reach.

    Without it gloo listens on what this host's name resolves to; with Debian's ``127.0.1.1 <hostname>`` line in
    /etc/hosts that is a loopback address, and every peer on another host is refused (seen on the emulated
    hosts). Then the ranks are pointed at the interface holding the address this node advertises. A value the
    user set is kept.
    """
    if "GLOO_SOCKET_IFNAME" in base_env or is_loopback_ip(advertised):
        return {}
    own = resolve(socket.gethostname())
    if own and not all(is_loopback_ip(a) for a in own):
        return {}
    for ifname, entries in psutil.net_if_addrs().items():
        if any(e.address.split("%", 1)[0] == advertised for e in entries):
            log.info("this host's name resolves to %s, not %s: the ranks' gloo uses interface %s (GLOO_SOCKET_IFNAME)",
                     ", ".join(own) or "nothing", advertised, ifname)
            return {"GLOO_SOCKET_IFNAME": ifname}
    return {}


def record_auth(settings: RdzvSettings) -> RecordAuth:
    """How this agent signs and checks control records: the job's secret file, a fresh secret for a
    single-host job, else (several agents, no file) the public key, with one warning line."""
    if settings.job_secret:
        return RecordAuth(settings.run_id, settings.job_secret, True, f"file {settings.job_secret_file}")
    if settings.standalone or settings.port == 0:
        return RecordAuth(settings.run_id, generate_secret(), True, "generated")
    log.warning("the rendezvous records of job %s are not authenticated (no job secret): any program that can "
                "reach %s:%d can stop or steer the job; give every agent the same private secret file with "
                "%s=FILE (the sbatch templates do)", settings.run_id, settings.host, settings.port, SECRET_FILE_ENV)
    return RecordAuth.unauthenticated(settings.run_id)


def _write_meta(store: TCPStore, settings: RdzvSettings, auth: RecordAuth) -> None:
    store.set(RUN_ID_KEY, settings.run_id)
    store.set(NPROC_KEY, str(settings.nproc_per_node))
    store.set(AUTH_KEY, auth.proof())
    store.set(MAGIC_KEY, MAGIC_VALUE)  # last: a client that sees it can read the others


# ---------------------------------------------------------------- connecting


def _probe(host: str, port: int, timeout: float) -> str | None:
    """None if HOST:PORT accepts a TCP connection, else a short reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror as exc:
        return f"name does not resolve: {exc.strerror or exc}"
    except ConnectionRefusedError:
        return "connection refused"
    except (socket.timeout, TimeoutError):
        return "connection timed out"
    except OSError as exc:
        return exc.strerror or str(exc)


def _handshake(host: str, port: int, timeout: float) -> TCPStore | BaseException | None:
    """Build a TCPStore client in a helper thread; None if it did not finish within TIMEOUT.

    A listener that accepts but never answers would block the caller forever. The helper
    thread stays blocked until that listener goes away; it is a daemon and holds no locks.
    """
    box: list[TCPStore | BaseException] = []

    def build() -> None:
        try:
            box.append(TCPStore(host, port, is_master=False, timeout=_td(timeout)))
        except BaseException as exc:  # handed to the caller, who decides
            box.append(exc)

    thread = threading.Thread(target=build, name="nvrx-store-connect", daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return box[0] if box else None


def _timed_out(exc: BaseException) -> bool:
    """A TCPStore handshake that gave up waiting (torch raises it as a plain error whose text says so).

    torch resolves the peer's address for every connection; a resolver that drops a query stalls it
    for its retry interval (5 s by default), which looks exactly like a listener that never answers.
    """
    return isinstance(exc, TimeoutError) or "timed out" in str(exc)


def connect_client(
    host: str,
    port: int,
    wait: float,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    refused_means_port_in_use: bool = False,
) -> TCPStore:
    """Connect to the store at HOST:PORT, retrying refusals for up to WAIT seconds.

    refused_means_port_in_use: the port is known to be bound on this machine, so a listener
    that keeps refusing is something else holding the port, not an agent still starting.
    """
    start = time.monotonic()
    delay = 0.05
    reason = "no attempt made"
    stalls = 0  # handshakes that timed out: one is forgiven (a name lookup stall), two mean "not a store"
    while True:
        reason = _probe(host, port, min(PROBE_TIMEOUT, max(0.1, wait)))
        if reason is None:
            got = _handshake(host, port, handshake_timeout)
            if isinstance(got, TCPStore):
                got.set_timeout(_td(DEFAULT_OP_TIMEOUT))
                return got
            if got is None or _timed_out(got):
                stalls += 1
                if stalls == 1:
                    log.debug("store %s:%d did not answer within %.0f s (a slow name lookup?); trying once more",
                                host, port, handshake_timeout)
                    continue
            if got is None:
                raise PortInUse(
                    f"port {port} on {host} is in use by another program (it accepts connections but does not "
                    f"answer like an nvrx rendezvous store); choose a free port with --rdzv-endpoint {host}:OTHER_PORT"
                )
            reason = _first_line(got)
        waited = time.monotonic() - start
        if waited >= wait:
            if refused_means_port_in_use:
                raise PortInUse(
                    f"port {port} on {host} is in use by another program that is not an nvrx rendezvous ({reason}); "
                    f"choose a free port with --rdzv-endpoint {host}:OTHER_PORT"
                )
            raise EndpointUnreachable(
                f"could not reach rendezvous endpoint {host}:{port} after {waited:.1f} s ({reason}); "
                "start the agent on the endpoint host first or fix --rdzv-endpoint"
            )
        log.debug("rendezvous endpoint %s:%d not ready (%s); retrying", host, port, reason)
        time.sleep(min(delay, max(0.0, wait - waited)))
        delay = min(delay * 2, 1.0)


def _poll_for_key(store: TCPStore, key: str, timeout: float) -> bool:
    """True once KEY exists; polls with check() so a miss prints no C++ timeout warning."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def verify_meta(store: TCPStore, settings: RdzvSettings, host: str, port: int, timeout: float,
                auth: RecordAuth | None = None) -> None:
    """Raise unless the store at HOST:PORT is an nvrx rendezvous for this very job."""
    if not _poll_for_key(store, MAGIC_KEY, timeout):
        raise PortInUse(
            f"{host}:{port} is a TCPStore but not an nvrx rendezvous (another launcher's store?); "
            f"choose a free port with --rdzv-endpoint {host}:OTHER_PORT"
        )
    magic = _meta_text(store, MAGIC_KEY, host, port)
    if magic != MAGIC_VALUE:
        raise RendezvousMismatch(
            f"the rendezvous at {host}:{port} speaks {magic!r} but this agent speaks {MAGIC_VALUE!r}; "
            "run the same nvrx version on every node"
        )
    run_id = _meta_text(store, RUN_ID_KEY, host, port)
    if run_id != settings.run_id:
        raise RendezvousMismatch(
            f"this agent has --rdzv-id {settings.run_id} but the rendezvous at {host}:{port} serves {run_id}; "
            "use the same --rdzv-id on every node"
        )
    nproc_text = _meta_text(store, NPROC_KEY, host, port)
    nproc = int(nproc_text) if nproc_text.isdigit() else None
    if nproc is None:
        raise RendezvousMismatch(f"the rendezvous at {host}:{port} has a malformed {NPROC_KEY} ({nproc_text[:40]!r}); "
                                 "another program wrote to it: choose a port only this job uses")
    if nproc != settings.nproc_per_node:
        raise RendezvousMismatch(
            f"this agent has --nproc-per-node {settings.nproc_per_node} but the job at {host}:{port} uses {nproc}; "
            "use the same --nproc-per-node on every node"
        )
    if auth is not None:
        theirs = _meta_text(store, AUTH_KEY, host, port)
        if not hmac.compare_digest(theirs.encode(), auth.proof().encode()):
            _greet(store, auth, secrets.token_hex(16))  # so the host names this agent at once, then refuse
        _verify_secret(theirs, auth, host, port)


def _verify_secret(theirs: str, auth: RecordAuth, host: str, port: int) -> None:
    """Raise RendezvousMismatch (one line) unless the store host signs with the same key as this agent."""
    if hmac.compare_digest(theirs.encode(), auth.proof().encode()):
        return
    fix = f"give every agent of the job the same secret file ({SECRET_FILE_ENV} or --job-secret-file)"
    if theirs.startswith("none:") and auth.authenticated:
        raise RendezvousMismatch(f"this agent has a job secret ({auth.source}) but the agent hosting the rendezvous "
                                 f"at {host}:{port} has none; {fix}")
    if theirs.startswith("secret:") and not auth.authenticated:
        raise RendezvousMismatch(f"the rendezvous at {host}:{port} is protected by a job secret and this agent has "
                                 f"none; {fix}")
    raise RendezvousMismatch(f"this agent's job secret ({auth.source}) differs from the one of the agent hosting the "
                             f"rendezvous at {host}:{port}; {fix}")


def _meta_text(store: TCPStore, key: str, host: str, port: int) -> str:
    """A meta key as short UTF-8 text; a RendezvousMismatch line when another program wrote something else."""
    raw = store.get(key)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        text = None
    if text is None or len(text) > 256:
        raise RendezvousMismatch(f"the rendezvous at {host}:{port} has a malformed {key}; "
                                 "another program wrote to it: choose a port only this job uses")
    return text


# ---------------------------------------------------------------- the launch greeting


def _greet(store: TCPStore, auth: RecordAuth, challenge: str) -> None:
    """Push this agent's greeting: its challenge, its secret's proof and where it runs (for the host's log)."""
    hello = {"challenge": challenge, "proof": auth.proof(), "host": socket.gethostname()[:200], "pid": os.getpid(),
             "secret": auth.source[:300]}
    store.queue_push(HELLO_QUEUE, json.dumps(hello))


def learn_launch(store: TCPStore, auth: RecordAuth, host: str, port: int, wait: float) -> RecordAuth:
    """AUTH bound to the launch of the store host at HOST:PORT, learnt by challenge and response.

    The answer is signed (with the launch-less key) at a key named by this agent's fresh challenge, so neither a
    value written without the secret nor an answer copied from an earlier launch checks. The greeting is pushed
    again every HANDSHAKE_TIMEOUT seconds (another program may have taken it off the queue) until WAIT runs out.
    """
    challenge = secrets.token_hex(16)
    key = LAUNCH_KEY + challenge
    base = auth.for_launch("")
    deadline = time.monotonic() + wait
    while True:
        _greet(store, auth, challenge)
        resend = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT)
        while time.monotonic() < resend:
            if _poll_for_key(store, key, max(0.0, resend - time.monotonic())):
                launch = _answer_launch(base, key, store.get(key), challenge)
                if launch is not None:
                    return auth.for_launch(launch)
                time.sleep(0.05)  # a forged answer: the host's replaces it
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"the agent hosting the rendezvous at {host}:{port} did not answer this agent's greeting within "
                f"{wait:g} s (overloaded, or another program is taking greetings off the store); relaunch, and keep "
                "the endpoint's port private to the job's nodes"
            )


def _answer_launch(base: RecordAuth, key: str, raw: bytes, challenge: str) -> str | None:
    """The launch nonce in the host's answer RAW, if it is signed for KEY and names CHALLENGE."""
    try:
        answer = json.loads(base.open(key, JOB_WIDE, raw))
    except (BadRecord, ValueError) as exc:
        log.warning("ignored an answer to this agent's greeting that the store host did not sign (%s)", exc)
        return None
    launch = answer.get("launch") if isinstance(answer, dict) else None
    if answer.get("challenge") != challenge or not isinstance(launch, str) or not 0 < len(launch) <= 64:
        return None
    return launch


def _parse_hello(raw: bytes) -> dict | None:
    """A greeting popped from the queue, or None when it is not one (anybody can push to the queue)."""
    if len(raw) > MAX_HELLO_BYTES:
        return None
    try:
        hello = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(hello, dict):
        return None
    challenge, proof = hello.get("challenge"), hello.get("proof")
    if not (isinstance(challenge, str) and len(challenge) == 32 and all(c in "0123456789abcdef" for c in challenge)):
        return None
    return hello if isinstance(proof, str) and len(proof) <= 256 else None


class LaunchGreeter:
    """On the store host: answers every joiner's greeting with the launch nonce, signed over its challenge, and
    names at once (one warning line, where it came from) any agent that tried to join with another secret.

    One daemon thread with a connection of its own, blocked in the store's queue pop (no polling)."""

    def __init__(self, host: str, port: int, auth: RecordAuth, run_id: str) -> None:
        self.auth = auth
        self.run_id = run_id
        self.refused: list[str] = []  # "host H (pid P)" of agents with another secret, in order (at most REFUSED_REPORTS)
        self._base = auth.for_launch("")
        self._stopping = False
        self._store = TCPStore(host, port, is_master=False, timeout=GREETER_WAIT)
        self._thread = threading.Thread(target=self._run, name="nvrx-rdzv-greeter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            try:
                raw = self._store.queue_pop(HELLO_QUEUE, block=True)
            except dist.DistError:  # the store stopped (the agent is exiting)
                return
            if not self._stopping:
                self.answer(bytes(raw))

    def answer(self, raw: bytes) -> None:
        """Answer one greeting RAW (ignored when it is not one)."""
        hello = _parse_hello(raw)
        if hello is None:
            log.debug("ignored a malformed greeting in the rendezvous store (%d bytes)", len(raw))
            return
        if not hmac.compare_digest(hello["proof"].encode(), self.auth.proof().encode()):
            self._refuse(hello)
            return
        key = LAUNCH_KEY + hello["challenge"]
        self._store.set(key, self._base.seal(key, JOB_WIDE, {"launch": self.auth.launch,
                                                             "challenge": hello["challenge"]}))

    def _refuse(self, hello: dict) -> None:
        where = f"host {str(hello.get('host'))[:200]!s} (pid {str(hello.get('pid'))[:12]})"
        if len(self.refused) >= REFUSED_REPORTS or where in self.refused:
            return
        self.refused.append(where)
        theirs = "no job secret" if str(hello["proof"]).startswith("none:") else "a different job secret"
        source = str(hello.get("secret"))[:300] if hello.get("secret") else "?"
        log.warning("an agent on %s tried to join job %s with %s (its secret: %s); it was refused: give every agent "
                    "of the job the same secret file (%s)", where, self.run_id, theirs, source, SECRET_FILE_ENV)

    def close(self, store: TCPStore | None) -> None:
        """Wake the thread through STORE (another connection: its own is blocked in the pop) so it ends."""
        self._stopping = True
        if store is not None:
            try:
                store.queue_push(HELLO_QUEUE, b"")
            except dist.DistError:
                pass
        self._thread.join(1.0)


# ---------------------------------------------------------------- the public object


class RendezvousStore:
    """This agent's handle on the rendezvous store: the server itself on the host, a client elsewhere."""

    def __init__(self, store: TCPStore, is_host: bool, host: str, port: int, auth: RecordAuth,
                 greeter: LaunchGreeter | None = None) -> None:
        self.store: TCPStore | None = store
        self.auth = auth  # signs and checks every control record of this launch (nvrx/launcher/agent/rdzv_auth.py)
        self.is_host = is_host
        self.host = host
        self.port = port
        self.greeter = greeter  # on the host of a multi-node job: answers joiners' greetings
        # the store host's start time (ns) from the signed launch nonce: orders launches for the checkpoint fence
        # (NVRX_LAUNCH, nvrx/ckpt/fence.py)
        self.launch = launch_time_ns(auth.launch)

    @property
    def refused(self) -> list[str]:
        """Where agents with another job secret came from (host only; empty elsewhere)."""
        return list(self.greeter.refused) if self.greeter is not None else []

    def new_client(self, timeout: float = DEFAULT_OP_TIMEOUT) -> TCPStore:
        """An extra connection, so one thread's blocking wait never stalls another's calls."""
        try:
            return TCPStore(self.host, self.port, is_master=False, timeout=_td(timeout))
        except dist.DistError as exc:
            raise RendezvousError(
                f"lost the rendezvous store at {self.host}:{self.port} ({_first_line(exc)}); "
                "the agent hosting it has probably exited"
            ) from None

    def close(self) -> None:
        """Drop the store; on the host this stops the server for every agent."""
        if self.greeter is not None:
            self.greeter.close(self.store)
        self.store = None

    def __repr__(self) -> str:
        return f"RendezvousStore({'host' if self.is_host else 'client'} {self.host}:{self.port})"


class StoreContact:
    """Whether this agent still reaches the rendezvous store, for the partition it cannot otherwise tell apart
    from a slow store: a TCP connection to a host whose link is cut neither fails nor answers (TCP retransmits for
    minutes, a reconnect retries "No route to host"), and every thread making a store request blocks in C++.

    A pinger thread (a connection of its own, one small request per INTERVAL) records each answer; a watcher
    thread, which never touches the store, calls ON_LOST(seconds without an answer) once nothing answered for
    TIMEOUT while armed. The agent arms it while its ranks run or it waits in rendezvous, and disarms it once the
    round's stop record was read (the store's host may then end the job and go away on purpose).
    """

    def __init__(self, rs: RendezvousStore, timeout: float, interval: float,
                 on_lost: Callable[[float], None]) -> None:
        self.rs = rs
        self.timeout = timeout
        self.interval = max(0.05, min(interval, timeout / 4))
        self.on_lost = on_lost
        self.last_answer = time.monotonic()
        self.lost = threading.Event()
        self._armed = False
        self._stop = threading.Event()
        self._change = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._ping, "nvrx-store-ping"), (self._watch, "nvrx-store-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def arm(self) -> None:
        """Count silence from now on (a pause while disarmed is not held against the store)."""
        self.last_answer = max(self.last_answer, time.monotonic())
        self._armed = True
        self._change.set()

    def disarm(self) -> None:
        self._armed = False
        self._change.set()

    def close(self) -> None:
        self._stop.set()
        self._change.set()

    def silent_for(self) -> float:
        return time.monotonic() - self.last_answer

    def _ping(self) -> None:
        store: TCPStore | None = None
        while not self._stop.is_set():
            try:
                if store is None:
                    # a plain connect first: a TCPStore connect to an unreachable host prints C++ warnings
                    if _probe(self.rs.host, self.rs.port, min(PROBE_TIMEOUT, self.timeout)) is None:
                        store = self.rs.new_client(timeout=self.timeout)
                if store is not None:
                    store.check([MAGIC_KEY])
                    self.last_answer = time.monotonic()
            except (dist.DistError, RendezvousError) as exc:
                log.debug("rendezvous store did not answer: %s", _first_line(exc))
                store = None
            self._stop.wait(self.interval)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._change.clear()
            if not self._armed:
                self._change.wait()
                continue
            left = self.last_answer + self.timeout - time.monotonic()
            if left > 0:
                self._change.wait(left)
                continue
            self.lost.set()
            self.on_lost(self.silent_for())
            return


def _host(addr: str, port: int, settings: RdzvSettings) -> RendezvousStore:
    """Serve the store on ADDR:PORT (port 0 = pick one) and write the meta keys."""
    sock = bind_listen(addr, port)
    actual = sock.getsockname()[1]
    store = serve_store(sock, addr)
    auth = record_auth(settings).for_launch(new_launch())
    greeter = None if settings.standalone or port == 0 else LaunchGreeter(addr, actual, auth, settings.run_id)
    _write_meta(store, settings, auth)
    log.info("hosting the rendezvous store on %s:%d", addr, actual)
    return RendezvousStore(store, True, addr, actual, auth, greeter)


def _join(host: str, port: int, settings: RdzvSettings, local_port_taken: bool) -> RendezvousStore:
    handshake = max(0.5, min(HANDSHAKE_TIMEOUT, settings.join_timeout))
    wait = handshake if local_port_taken else settings.join_timeout
    store = connect_client(host, port, wait, handshake, refused_means_port_in_use=local_port_taken)
    auth = record_auth(settings)
    verify_meta(store, settings, host, port, handshake, auth)
    auth = learn_launch(store, auth, host, port, max(handshake, settings.join_timeout))
    log.info("joined the rendezvous store at %s:%d", host, port)
    return RendezvousStore(store, False, host, port, auth)


def _guarded(fn: Callable[[], RendezvousStore], host: str, port: int) -> RendezvousStore:
    """Turn low-level store errors into one-line RendezvousErrors."""
    try:
        return fn()
    except RendezvousError:
        raise
    except dist.DistError as exc:
        raise RendezvousError(f"rendezvous store at {host}:{port} failed: {_first_line(exc)}") from None


def open_rendezvous_store(settings: RdzvSettings) -> RendezvousStore:
    """Host the store if the endpoint is this machine (and the port is free), else connect to it."""
    quiet_cpp_warnings(os.environ)  # a forged counter would print torch C++ stacks here; the agent says it in one line
    if settings.standalone or settings.port == 0:
        return _guarded(lambda: _host("127.0.0.1", 0, settings), "127.0.0.1", 0)
    host, port = settings.host, settings.port
    addr = local_bind_address(host)
    if settings.hosts_only_as_node0 and settings.node_rank not in (None, 0):
        addr = None  # topology from Slurm: node 0 hosts the store, whatever else resolves as local
    if addr is None:
        return _guarded(lambda: _join(host, port, settings, local_port_taken=False), host, port)
    try:
        return _guarded(lambda: _host(addr, port, settings), addr, port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise RendezvousError(
                f"cannot listen on rendezvous endpoint {addr}:{port} ({exc.strerror}); "
                "pick another port with --rdzv-endpoint"
            ) from None
    log.info("%s:%d is taken on this machine; joining it as another agent of the same job", addr, port)
    return _guarded(lambda: _join(addr, port, settings, local_port_taken=True), addr, port)
