"""``kvgate bench``: a Store's throughput next to a baseline measured in the same run
(``store``; the disk baselines in ``disk_baseline``; each connector's raw client through
``gateway.client_baseline``), and codecs on KV samples (``codecs``, ``kv_samples``,
``rd_plot``; a real decoder's K/V: ``smollm2_sample`` on ``smollm2_model``, ``kv_capture`` and
``texts``, measured end to end by ``end_to_end``). It imports the core, never another wing.
"""
