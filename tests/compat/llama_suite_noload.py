"""A pytest plugin for llama.cpp's server test suite: its session fixture starts every server preset once only
to cache model downloads (`--embeddings` and the reranker included, which a server may refuse), and the shim
replaces those downloads; the preloading becomes a no-op."""


def pytest_configure(config):
    import utils  # the suite's own helpers, on its path

    utils.ServerPreset.load_all = staticmethod(lambda: None)
