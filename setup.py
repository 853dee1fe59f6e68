from setuptools import find_packages, setup

setup(
    name="resformer_jax",
    version="0.1.0",
    description="Value-residual transformers (ResFormer, SVFormer) pretraining in JAX/Flax",
    packages=find_packages(include=["resformer_jax*", "data_prep*"]),
    package_data={"resformer_jax.train": ["gpu_specs/*.txtpb"]},  # GPU target configs for the compile command
    python_requires=">=3.11",  # what jax 0.10 (the release the compile check and CI run) requires
    install_requires=[
        "jax>=0.4.35,<0.12",
        "flax>=0.10,<0.14",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11,<0.14",
        "grain>=0.2.10,<0.3",
        "array_record>=0.7,<0.10",
        "ml-collections>=0.1.1,<2",
        "tensorflow-datasets>=4.9.7,<5",
        "importlib_resources",  # undeclared need of tfds' adhoc builder
        "tensorboardX>=2.6,<3",
        "tokenizers>=0.20,<1",
        "safetensors>=0.4",  # Hugging Face checkpoints (import for analysis and initialisation)
        "absl-py>=2.1",
        "numpy>=1.26",
        "zstandard>=0.22",
        "pyarrow>=15",
        "matplotlib>=3.8",
        "psutil>=5.9",
    ],
    extras_require={
        # What README's second command adds for the tests: pytest (and pytest-xdist: the suite is bound by XLA's
        # single-threaded compiles, so two workers on two cores take about two thirds of the time), and the clients
        # and emulators tests/test_cloud.py runs gs:// and s3:// run directories against. boto3 comes through s3fs's own
        # extra (aiobotocore pins the botocore it needs, so boto3 is chosen to match it, not independently:
        # an independent boto3 sent older pips backtracking for minutes into ResolutionImpossible).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "tensorboard>=2.15", "gcsfs>=2024.2", "s3fs[boto3]>=2024.2",
                 "gcp-storage-emulator>=2024.8", "moto[server]>=5.0"],
        # Run directories on object storage (gs://, s3://): epath goes through fsspec.
        "gcs": ["gcsfs>=2024.2"],
        "s3": ["s3fs>=2024.2"],
        # The JAX the compile check (`aot`) and CI use, pinned: a GPU or TPU node then runs the kernels and flags
        # checked here (JAX 0.11 deprecates Pallas' Triton backend; README says what to do when it is gone).
        "gpu": ["jax[cuda12]==0.10.2", "gcsfs>=2024.2"],
        "tpu": ["jax[tpu]==0.10.2", "gcsfs>=2024.2"],
        "eval": ["tensorboard>=2.15"],
        "beam": ["apache-beam>=2.60"],
        # `python -m resformer_jax.compile`: the TPU and GPU compilers, to compile for TPU slices and GPU nodes
        # from a CPU machine (about 2 GB): libtpu (jax[tpu]), the CUDA PJRT plugin without the CUDA runtime
        # libraries (jax[cuda12-local]; nothing runs here) and ptxas (nvidia-cuda-nvcc-cu12) for GPU machine code.
        # Pinned to the jax these were checked with: the plugins must match jaxlib exactly.
        "aot": ["jax[tpu]==0.10.2", "jax[cuda12-local]==0.10.2", "nvidia-cuda-nvcc-cu12>=12.6,<13"],
        "lm_eval": ["lm-eval>=0.4.8"],
    },
)
