"""A KvcdConnector that kills the daemon (SIGKILL, the pid in $KVCD_TEST_KILL_PID) when the
worker is about to run its $KVCD_TEST_KILL_ON_LOAD-th load (1-based), and returns once the
daemon's port refuses connections: the load then meets a dead daemon, as when a daemon dies
during an engine's load. Used by test_connector.py through kv_connector_module_path."""
import os
import signal
import socket
import time

from kvcd.vllm import KvcdConnector


def _refused(target: str) -> bool:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


class KillDaemonOnLoad(KvcdConnector):
    loads_seen = 0

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if meta.loads:
            KillDaemonOnLoad.loads_seen += 1
            if KillDaemonOnLoad.loads_seen == int(os.environ["KVCD_TEST_KILL_ON_LOAD"]):
                os.kill(int(os.environ["KVCD_TEST_KILL_PID"]), signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not _refused(self.cfg.target):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the killed daemon still accepts connections")
                    time.sleep(0.05)
        super().start_load_kv(forward_context, **kwargs)
