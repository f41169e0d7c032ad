"""vLLM on kvgate: ``KvgateConnector`` (``connector.py``, loaded by vLLM through
``kv_connector_module_path = "gateway.vllm.connector"``) saves and loads KV pages through a
Store. Everything but ``connector.py`` runs without vLLM: ``settings`` (its extra config),
``plan`` (the scheduler's bookkeeping), ``pages`` (gather and scatter of pages), ``bridge``
(the Store on its own loop thread) and ``lookup`` (how the scheduler asks the worker). It
imports the core, never another wing.
"""
