__version__ = "0.1.0"

# Importing transformers costs 5 s on 2 cores, and every process the kit starts imports marin_study: the Hugging Face
# classes of nbs/13a_hf_model.ipynb are registered with transformers' Auto classes when transformers is imported,
# before or after marin_study, never by importing marin_study alone.
import importlib
import importlib.abc
import importlib.util
import sys
import warnings


def _register() -> None:
    try: importlib.import_module("marin_study.hf_model")  # registers on import
    except Exception as e:  # a transformers the model does not fit must not break every import of transformers
        warnings.warn(f"marin_study: the kit's model is not registered with transformers ({e})")


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    "Run transformers' own import, then register the kit's model with its Auto classes."
    def find_spec(self, name, path=None, target=None):
        if name != "transformers": return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves again
        try: spec = importlib.util.find_spec(name)
        finally: sys.meta_path.insert(0, self)
        if spec is None: return None  # transformers is not installed: nothing to register with
        load = spec.loader.exec_module
        def exec_module(module):  # a spec may be looked up without importing (availability checks): wait for this
            if self in sys.meta_path: sys.meta_path.remove(self)
            load(module)
            _register()
        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules: _register()
else: sys.meta_path.insert(0, _RegisterWithTransformers())
