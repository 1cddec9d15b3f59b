"""Readers of foreign checkpoint formats, each returning a :class:`~weightvault.Checkpoint`.

The format is recognised from the file's first bytes, never from its name alone. The
table below is :data:`._registry.FORMATS`, where each row's sniff and reader are:

==============  ====================================================  ======================
format          first bytes                                           reader
==============  ====================================================  ======================
safetensors     u64 header length, then ``{``                         :class:`SafetensorsFile`
mxnet           u64 ``0x112``, u64 ``0`` (NDArray list)               :mod:`.mxnet`
torch           zip holding ``<name>/data.pkl`` (``torch.save``)      :mod:`.torch_pickle`
pickle          ``\\x80`` + protocol (legacy ``torch.save``, pickle)    :mod:`.torch_pickle`
npz / npy       zip of ``*.npy`` members / ``\\x93NUMPY``               :mod:`.npz`
hdf5            ``\\x89HDF\\r\\n\\x1a\\n`` (Keras ``.weights.h5``)          :mod:`.keras_h5`
keras           zip holding ``config.json`` and ``model.weights.h5``  :mod:`.keras_archive`
==============  ====================================================  ======================

Example:
    >>> from weightvault.formats import detect, open_any
    >>> detect("model-0000.params")
    'mxnet'
    >>> with open_any("model-0000.params") as ckpt:
    ...     ckpt.names[:2]
    ['arg:conv0_weight', 'arg:conv0_bias']
"""

from __future__ import annotations

from ._registry import FOREIGN, detect, open_any

__all__ = ["FOREIGN", "detect", "open_any"]
