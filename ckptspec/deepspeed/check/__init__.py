"""Check: a DeepSpeed checkpoint's files against the document that describes them.

``domain/`` holds the CK2xx checks of one ZeRO domain's files against its 1.x manifest, ``cross_domain/``
those only a checkpoint index's whole file set can tell (CK207, CK23x, CK24x). ``zero.py`` validates a
plain ZeRO checkpoint (choosing its manifest), ``checkpoint_index.py`` one described by a checkpoint
index; ``copies.py`` and ``recorded.py`` read the manifest copies a checkpoint carries.
"""
