"""An S3 API server on loopback for the object-store tests: moto's S3 in this process (its
buckets outlive a stop), served by werkzeug on a fixed port so that it can be stopped and started
again, with a hook that stops it when a request's path matches (a fault at an exact moment)."""
import logging
import re
import socket
import threading

BUCKET_KEY, BUCKET_SECRET = "testing", "testing"


class S3Server:
    """``start()``/``stop()`` on one loopback port; ``stop_on(pattern)`` stops the server at the
    first write whose path matches (that request fails as a server going away would)."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread = None
        self._trigger = None
        self.stopped_at = None  # the path whose write stopped the server
        self.stopped = threading.Event()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)

    @property
    def storage_options(self):
        return {"endpoint_url": self.endpoint, "key": BUCKET_KEY, "secret": BUCKET_SECRET,
                "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2}}}

    def _app(self):
        from moto.server import DomainDispatcherApplication, create_backend_app

        moto = DomainDispatcherApplication(create_backend_app)

        def app(environ, start_response):
            trigger = self._trigger
            if trigger is not None and environ["REQUEST_METHOD"] in ("PUT", "POST") and \
                    re.search(trigger, environ.get("PATH_INFO", "")):
                self._trigger = None
                self.stopped_at = environ["PATH_INFO"]
                threading.Thread(target=self.stop, daemon=True).start()
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"stopping"]
            return moto(environ, start_response)
        return app

    def start(self):
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", self.port, self._app(), threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.stopped.clear()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.stopped.set()

    def stop_on(self, pattern):
        """Stop at the first PUT/POST whose path matches ``pattern`` (a regular expression)."""
        self.stopped_at = None
        self._trigger = pattern

    def running(self):
        """Started again if a test stopped it (the buckets and objects are still there)."""
        if self._server is None:
            self.start()
        return self

    def store(self, prefix):
        """A Store under ``s3://runs/<prefix>`` of this server."""
        from sparkring import Store

        return Store(f"s3://runs/{prefix}", storage_options=self.storage_options)

    def make_bucket(self, name):
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=BUCKET_KEY,
                     aws_secret_access_key=BUCKET_SECRET, region_name="us-east-1").create_bucket(Bucket=name)
