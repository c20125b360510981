"""The one contract between event writers and `nvrx inspect`: typed event records and their JSON lines.

``records``: every event a frozen record class (``RdzvRound``, ``HangDetected``, ...); the schema.
``log``: ``EventLog.emit(record)``, the only way to write one. ``reader``: decode a line and check its fields
against the types the records declare (``EVENT_FIELDS``, ``field_problem``), so writers and readers cannot drift.
Every name is re-exported here: ``from nvrx.events import RdzvRound, EventLog``.
"""

from nvrx.events.records import *  # noqa: F401,F403

from nvrx.events.log import EventLog, Listener, _open_private  # noqa: F401
from nvrx.events.reader import *  # noqa: F401,F403

