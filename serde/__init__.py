"""kvgate codecs: one module per codec, registered under the ``kvgate.serde`` entry points."""
