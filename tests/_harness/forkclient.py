"""``ckptspec ARGS`` run by the fork server at ``$CKPTSPEC_FORKSERVER`` (see forkserver.py).

It hands the server its arguments, environment, working directory, stdin, stdout and stderr,
and exits as the command did (by the same signal, if one killed it). Standard library only, so
it starts in milliseconds under ``python -S -I``.
"""

import json
import os
import signal
import socket
import sys

env = dict(os.environ)
server = env.pop("CKPTSPEC_FORKSERVER")
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
connection.connect(server)
request = {"args": sys.argv[1:], "env": env, "cwd": os.getcwd()}
socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
reply = connection.recv(4096)
code = json.loads(reply)["returncode"] if reply else 1
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
