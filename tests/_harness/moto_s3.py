"""moto's S3 server, as the ``moto_server`` command runs it (``moto.server.main``, same arguments), with one of its
helpers memoized: ``backends.list_of_moto_modules`` lists moto's package directory (about 200 ``stat`` calls) twice
per request, to find the backend a Host header names; measured, 30% of the server's CPU in the S3 crash tests. That
directory does not change while the server runs. Nothing else differs: the same application answers every request.
"""

import sys

from moto import backends
from moto.server import main

_MODULES = tuple(backends.list_of_moto_modules())
backends.list_of_moto_modules = lambda: iter(_MODULES)  # its callers take an iterable (`in`, `for`)

if __name__ == "__main__":
    main(sys.argv[1:])
