"""Rendezvous errors, kept free of torch so the CLI can name them before the agent imports torch."""

from __future__ import annotations


class RendezvousError(RuntimeError):
    """The rendezvous cannot proceed; the message is one line telling the user what to fix."""


class EndpointUnreachable(RendezvousError):
    """Nothing accepted connections at the endpoint within the join timeout."""


class PortInUse(RendezvousError):
    """The endpoint port is held by something that is not an nvrx rendezvous."""


class RendezvousMismatch(RendezvousError):
    """This agent and the rendezvous disagree on the job (run id, nproc per node, version)."""
