"""Leaf helpers shared by every nvrx package. Imports nothing of ours (a test checks).

``errors`` (the ``NvrxError`` root, ``ConfigError``), ``exit_codes``, ``signals`` (the one signal
parser), ``process`` (die with the parent, process titles), ``files`` (atomic JSON write).
"""
