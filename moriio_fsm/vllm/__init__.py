"""The vLLM KV connector: ``MoRIIOFSMConnector`` and the pieces it is made of.

Importing this package does not import vLLM; ``moriio_fsm.vllm.connector`` does (it
subclasses vLLM's ``KVConnectorBase_V1``) and is what ``kv_connector_module_path`` names.
"""
