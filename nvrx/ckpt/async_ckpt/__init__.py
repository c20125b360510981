"""Asynchronous DCP save: ``state_dict_saver`` (plan / finalize, metadata cache), ``filesystem_async``
(the storage writer), ``core`` (the request queue), and the persistent writer process behind them."""
