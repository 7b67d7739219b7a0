__version__ = "0.1.0"

# Importing transformers costs 5 s on 2 cores, and every process the kit starts imports marin_study: the Hugging Face
# classes of nbs/13a_hf_model.ipynb are registered with transformers' Auto classes when transformers is imported,
# before or after marin_study, never by importing marin_study alone.
import importlib
import importlib.abc
import importlib.util
import sys


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    "Run transformers' own import, then register the kit's model with its Auto classes."
    def find_spec(self, name, path=None, target=None):
        if name != "transformers": return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None: return None  # transformers is not installed: nothing to register with
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            importlib.import_module("marin_study.hf_model")  # registers on import
        spec.loader.exec_module = exec_module
        return spec


if "transformers" in sys.modules:
    importlib.import_module("marin_study.hf_model")
else:
    sys.meta_path.insert(0, _RegisterWithTransformers())
