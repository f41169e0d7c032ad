"""``kvgate bench``: a Store's throughput next to a baseline measured in the same run
(``store``; the disk baselines in ``disk_baseline``; each connector's raw client through
``gateway.client_baseline``), and codecs on KV samples (``codecs``, ``kv_samples``,
``rd_plot``; a real decoder's K/V: ``smollm2_sample`` on ``smollm2_model``, ``kv_capture`` and
``texts``, measured end to end by ``end_to_end``), and how cost grows (``scale_objects``
with its child steps in ``scale_tier``; ``scale_clients`` with its clients in ``scale_load``;
``scale_stats``, ``scale_plot``). It imports the core, never another wing.
"""
