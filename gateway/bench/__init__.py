"""``kvgate bench``: a Store's throughput next to a baseline measured in the same run
(``store``; the disk baselines in ``disk_baseline``; each connector's raw client through
``gateway.client_baseline``), and codecs on KV samples (``codecs``, ``kv_samples``,
``rd_plot``). It imports the core, never another wing.
"""
