"""The engine core: the offload context (:mod:`~offload_examples.core.api`), the life of an offloaded
tensor (:mod:`~offload_examples.core.engine`) and the parts it is made of. It imports nothing from
the features, instruments or scenarios."""
