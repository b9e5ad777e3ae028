r"""Any method on a tiny random BERT and small synthetic data: seconds on a CPU.

Used by the tests. ``arg`` is ``<method>[,key=value...]``, e.g.::

    python -m moddiffy_jax.main --config=configs/tiny.py:moddiffy_par --workdir=/tmp/t

The numbers it produces mean nothing: the model is random and tiny and the
data synthetic.
"""

from moddiffy_jax.config_lib import experiment_config


def get_config(arg="moddiffy_par"):
    method, _, rest = (arg or "moddiffy_par").partition(",")
    return experiment_config(method, ",".join(filter(None, ["model=tiny", rest])))
