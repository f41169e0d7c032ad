"""``kvtc``: a calibrated transform codec (see ``serde.kvtc.codec``)."""
