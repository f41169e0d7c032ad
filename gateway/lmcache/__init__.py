"""LMCache compatibility: its lm:// wire format (``wire``) and a server of it on a Store
(``server``), so an unmodified LMCache uses kvgate as its remote store.

LMCache's config keys are read by the core's config loader (``gateway.config_lmcache``), since
``Store("lmcache.yaml")`` needs them without this wing. It imports the core, never another
wing.
"""
