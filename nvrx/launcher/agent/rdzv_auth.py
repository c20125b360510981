"""Authenticated control records: the job secret and the HMAC every rendezvous record carries.

torch's TCPStore has no authentication: any process that reaches the endpoint can read and write any key.
So every control record an agent acts on (join, closed round, stop, finished, keepalive, round hint,
process-group address, straggler reports and exclusion marks) is stored as ``nvrx1:<hex MAC>:<record JSON>``,
where the MAC (HMAC-SHA-256 with the job secret) covers the run id, the launch, the round and the store key it was
written to, besides the record. (No JSON envelope: a 256-node closed record is parsed once, not twice.) A record
copied to another key, round, run or launch fails the check (replay), and so does anything written without the
secret: the agents ignore it.

The launch is a nonce the store host draws when it starts hosting (``new_launch``): its clock in ns, then a random
part. `nvrx resume` relaunches inside one Slurm allocation with the same run id and secret; without the nonce, a
record of an earlier launch would be valid in the next one. A joiner learns the nonce from the host by challenge and
response (nvrx/launcher/agent/store.py): the host's answer is signed over the joiner's fresh challenge, so an answer
copied from an earlier launch does not check either. The time part orders launches for the checkpoint fence
(``NVRX_LAUNCH``, nvrx/ckpt/fence.py): it reaches an agent only inside that signed answer, so a program without
the secret cannot make the job's ranks stamp or raise a fence with a launch of its choosing.

Torch-free (the CLI's config builder loads the secret before torch is imported).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nvrx.launcher.agent.rdzv_records import MAX_RECORD_BYTES, BadRecord, _json_object
from nvrx.common.errors import ConfigError
from nvrx.common.files import NotRegularFile, open_regular

SECRET_FILE_ENV = "NVRX_JOB_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
JOB_WIDE = -1  # the "round" of records that belong to no round (finished, round hint, exclusion marks)
# Used when a multi-node job has no secret file: records keep their shape and replay checks, but anybody can
# compute this MAC; the agents say so once at start.
PUBLIC_KEY = b"nvrx-rendezvous-without-a-job-secret"
_DOMAIN = b"nvrx-rdzv-record/2"  # /2: the MAC covers the launch
_PROOF_LABEL = b"nvrx-rdzv-secret-proof/1"
_PREFIX = b"nvrx1:"
_MAC_HEX = 64


class ForgedRecord(BadRecord):
    """A well-formed envelope whose MAC does not check: written without the job secret, or copied from
    another key, round, run or launch (replay)."""


def new_launch() -> str:
    """A fresh launch nonce, drawn once by the agent that hosts the store: ``<time in ns>-<32 hex digits>``."""
    return f"{time.time_ns()}-{secrets.token_hex(16)}"


def launch_time_ns(launch: str) -> str:
    """The store host's start time (ns, digits) in the launch nonce LAUNCH; "" when it has none."""
    head, sep, _ = launch.partition("-")
    return head if sep and head.isdigit() and len(head) < 24 else ""


def load_secret(path: str | Path) -> bytes:
    """The job secret from PATH, which must be a regular file of ours that only we can read (ConfigError
    otherwise, one line). Surrounding whitespace is dropped, so `head -c 32 /dev/urandom | base64 > f` works."""
    shown = str(path)
    try:
        fd = open_regular(path, follow_symlinks=False)  # a fifo must not block the launch until someone writes
    except NotRegularFile as exc:
        raise ConfigError(f"job secret file {shown} {exc.strerror}; point {SECRET_FILE_ENV} / --job-secret-file "
                          "at a file") from None
    except OSError as exc:
        raise ConfigError(f"job secret file {shown} ({SECRET_FILE_ENV} / --job-secret-file): cannot open it "
                          f"({exc.strerror or exc}); create it with: (umask 077; head -c 32 /dev/urandom "
                          f"| base64 > {shown})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ConfigError(f"job secret file {shown} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
                              "use a secret file you own")
        if st.st_mode & 0o077:
            raise ConfigError(f"job secret file {shown} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"make it private: chmod 600 {shown}")
        data = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    if not secret:
        raise ConfigError(f"job secret file {shown} is empty; fill it with random bytes: "
                          f"head -c 32 /dev/urandom | base64 > {shown}")
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"job secret file {shown} is longer than {MAX_SECRET_BYTES} bytes; is it the right file?")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"job secret file {shown} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; "
                          f"fill it with random bytes: head -c 32 /dev/urandom | base64 > {shown}")
    return secret


def generate_secret() -> bytes:
    """A fresh secret for a single-host job (--standalone): no other agent needs to know it."""
    return secrets.token_bytes(32)


@dataclass(frozen=True)
class RecordAuth:
    """Signs and checks the control records of one run."""

    run_id: str
    key: bytes = field(repr=False)
    authenticated: bool  # False: the public key (no secret configured); records are checked, not authenticated
    source: str  # where the key came from, for messages: "file PATH" | "generated" | "none"
    launch: str = ""  # the launch nonce (new_launch); "" only until a joiner has it (the greeting itself)

    @classmethod
    def unauthenticated(cls, run_id: str) -> "RecordAuth":
        return cls(run_id, PUBLIC_KEY, False, "none")

    def for_launch(self, launch: str) -> "RecordAuth":
        """The same key, signing and checking the records of LAUNCH."""
        return replace(self, launch=launch)

    def mac(self, key_name: str, round: int, body: bytes) -> bytes:
        """HMAC-SHA-256 over the run id, the launch, the round, the store key and the body (hex)."""
        msg = b"\0".join((_DOMAIN, self.run_id.encode(), self.launch.encode(), str(round).encode(),
                          key_name.encode(), body))
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key_name: str, round: int, content: dict) -> str:
        """CONTENT as the signed record to store at KEY_NAME for ROUND (JOB_WIDE for records of no round)."""
        body = json.dumps(content, separators=(",", ":"), default=str).encode()
        return (_PREFIX + self.mac(key_name, round, body) + b":" + body).decode()

    def open(self, key_name: str, round: int, raw: bytes | str) -> str:
        """The record (JSON text) in RAW read from KEY_NAME, if its MAC checks for ROUND.

        BadRecord if RAW is garbage (e.g. not JSON); ForgedRecord if it is a record that was not signed with
        this job's secret for this key, round and run (the message says which).
        """
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) > MAX_RECORD_BYTES:
            raise BadRecord(f"{len(data)} bytes, more than any record nvrx writes")
        if not data.startswith(_PREFIX):
            _json_object(data)  # garbage says what it is ("not JSON", ...)
            raise ForgedRecord("no signature: not written by an agent of this job")
        mac, body = data[len(_PREFIX):len(_PREFIX) + _MAC_HEX], data[len(_PREFIX) + _MAC_HEX + 1:]
        if data[len(_PREFIX) + _MAC_HEX:len(_PREFIX) + _MAC_HEX + 1] != b":":
            raise ForgedRecord("malformed signature")
        if not hmac.compare_digest(mac, self.mac(key_name, round, body)):
            raise ForgedRecord("signature does not match: written without the job secret, or copied from another "
                               "key, round, run or launch")
        try:
            return body.decode()
        except UnicodeDecodeError:
            raise BadRecord("not UTF-8") from None

    def proof(self) -> str:
        """What the store host publishes so joiners can tell "same secret" from "different secret" without
        the secret ever entering the store: an HMAC of a fixed label and the run id, plus how it was set up."""
        digest = hmac.new(self.key, _PROOF_LABEL + b"\0" + self.run_id.encode(), hashlib.sha256).hexdigest()
        return f"{'secret' if self.authenticated else 'none'}:{digest}"


def claimed_node(body_or_raw: bytes | str) -> str:
    """The node a (possibly forged) record names, for the log: untrusted, only what the record says."""
    data = body_or_raw.encode() if isinstance(body_or_raw, str) else bytes(body_or_raw)
    if data.startswith(_PREFIX):
        data = data[len(_PREFIX) + _MAC_HEX + 1:]
    try:
        obj = _json_object(data)
    except BadRecord:
        return ""
    for name in ("by_node", "node_id", "node"):
        value = obj.get(name)
        if isinstance(value, str):
            return value[:80]
    return ""


class RejectedRecords:
    """Logs and records (events) the store values an agent ignores or cannot accept, bounded.

    A value is reported once (per key and bytes), and at most BURST reports per WINDOW seconds: a program
    flooding the store with forged records cannot fill the log or the disk. The next report after a quiet
    spell says how many were left out.
    """

    BURST = 20
    WINDOW = 60.0
    MEMORY = 4096  # distinct (key, value) pairs remembered

    def __init__(self, events: Any, log: logging.Logger) -> None:
        self.events = events
        self.log = log
        self._lock = threading.Lock()
        self._seen: set[tuple[str, bytes]] = set()
        self._window_start = 0.0
        self._in_window = 0
        self._suppressed = 0

    def report(self, key: str, raw: bytes, exc: BadRecord, action: str) -> None:
        """One warning line and one event for RAW at KEY (rdzv_forged_record if it failed the MAC check,
        else rdzv_bad_record), unless it was reported before or the rate limit is reached."""
        from nvrx.events import RdzvBadRecord, RdzvForgedRecord

        raw = bytes(raw)[:512]
        with self._lock:
            if (key, raw) in self._seen:
                return
            if len(self._seen) >= self.MEMORY:
                self._seen.clear()
            self._seen.add((key, raw))
            now = time.monotonic()
            if now - self._window_start > self.WINDOW:
                self._window_start, self._in_window = now, 0
            if self._in_window >= self.BURST and action == "ignored":
                self._suppressed += 1
                return
            self._in_window += 1
            suppressed, self._suppressed = self._suppressed, 0
        more = f" ({suppressed} more ignored records not logged)" if suppressed else ""
        if isinstance(exc, ForgedRecord):
            claims = claimed_node(raw)
            self.log.warning("unauthenticated record %s in the rendezvous store (%s%s); %s%s", key, exc,
                             f"; it names node {claims}" if claims else "", action, more)
            self.events.emit(RdzvForgedRecord(key=key, problem=str(exc), claims=claims or None, action=action,
                                              suppressed=suppressed))
        else:
            self.log.warning("malformed record %s in the rendezvous store (%s); %s%s", key, exc, action, more)
            self.events.emit(RdzvBadRecord(key=key, problem=str(exc), action=action))
