"""``ckptspec ARGS`` run by the fork server at ``$CKPTSPEC_FORKSERVER`` (see forkserver.py); ``--python-c CODE
ARGS``: ``python -c CODE ARGS`` run there (the docs' ``python run`` blocks, which import torch: a new interpreter
paid 1-1.5 s of CPU importing it each).

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
server = env["CKPTSPEC_FORKSERVER"]
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
connection.connect(server)
if sys.argv[1:2] == ["--python-c"]:  # the program keeps $CKPTSPEC_FORKSERVER: the `ckptspec` it runs is this client
    request = {"python": sys.argv[2], "args": sys.argv[3:], "env": env, "cwd": os.getcwd()}
else:
    del env["CKPTSPEC_FORKSERVER"]
    request = {"args": sys.argv[1:], "env": env, "cwd": os.getcwd()}
socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
reply = connection.recv(4096)
code = json.loads(reply)["returncode"] if reply else 1
if code < 0:
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset (EINVAL)
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
