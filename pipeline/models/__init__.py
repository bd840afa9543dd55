"""Model specs → warm diffusers pipelines: families, offline random-weight builds, loading.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. A worker calls
:func:`load_pipeline` once at start with the model name of its pool and keeps the result resident.

Modules: :mod:`.families` (per family: pipeline class, denoiser, reference dtype, tiny VAE),
:mod:`.configs` (the public checkpoints' component configs as data), :mod:`.offline` (the offline
models built from them), :mod:`.build` (instantiation: on a device, on ``meta``, into the cache),
:mod:`.tokenizers` (offline tokenizers), :mod:`.load` (hub ids, directories, single files).
"""

from pipeline.models.build import build_offline_model, construct_pipeline, parameter_counts
from pipeline.models.configs import SD_BETAS
from pipeline.models.families import FAMILY_SPECS, detect_family, reference_dtype
from pipeline.models.load import load_pipeline
from pipeline.models.offline import OFFLINE_MODELS, OfflineModel

__all__ = ["OFFLINE_MODELS", "FAMILY_SPECS", "SD_BETAS", "OfflineModel", "build_offline_model", "construct_pipeline",
           "detect_family", "load_pipeline", "parameter_counts", "reference_dtype"]
