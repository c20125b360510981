"""Rendezvous errors, kept free of torch so the CLI can name them before the agent imports torch."""

from __future__ import annotations

from nvrx.common.errors import NvrxError

class RendezvousError(NvrxError, RuntimeError):
    """The rendezvous cannot proceed; the message is one line telling the user what to fix."""

    usage = False  # True: the command line or setup is wrong (exit 2), not a fault of the running job


class EndpointUnreachable(RendezvousError):
    """Nothing accepted connections at the endpoint within the join timeout."""

    usage = True


class PortInUse(RendezvousError):
    """The endpoint port is held by something that is not an nvrx rendezvous."""

    usage = True


class RendezvousMismatch(RendezvousError):
    """This agent and the rendezvous disagree on the job (run id, nproc per node, version)."""

    usage = True
