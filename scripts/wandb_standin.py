#!/usr/bin/env python3
"""A stand-in for the W&B server on 127.0.0.1, for tests: answers what `wandb sync` asks (GraphQL at
/graphql, the run's file stream, file uploads) and records every request as one JSON line in LOG.

    python3 scripts/wandb_standin.py LOG      # prints the port it listens on, then serves until killed

Only for tests: it accepts any API key and keeps nothing but the log.
"""
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOG = sys.argv[1]
lock = threading.Lock()


def record(entry):
    with lock, open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


def graphql(body, base):
    query = body.get("query", "")
    variables = body.get("variables") or {}
    if "upsertBucket" in query:
        name = variables.get("name") or "run"
        project = variables.get("project") or variables.get("modelName") or "project"
        entity = variables.get("entity") or variables.get("entityName") or "entity"
        return {"upsertBucket": {"inserted": True, "bucket": {
            "id": "bucket-" + name, "name": name, "displayName": variables.get("displayName") or name,
            "description": None, "config": "{}", "sweepName": None, "summaryMetrics": "{}",
            "historyLineCount": 0, "eventsLineCount": 0, "logLineCount": 0,
            "project": {"id": "project-1", "name": project, "entity": {"id": "entity-1", "name": entity}},
        }}}
    if "createRunFiles" in query:
        files = variables.get("files") or []
        return {"createRunFiles": {"runID": "bucket-1", "uploadHeaders": [],
                                   "files": [{"name": f, "uploadUrl": f"{base}/upload/{f}"} for f in files]}}
    if "serverInfo" in query or "ServerInfo" in query:
        return {"serverInfo": {"features": [], "latestLocalVersionInfo": None, "cliVersionInfo": {},
                               "availableBucketProviders": [], "latestVersionInfo": None}}
    if "viewer" in query:
        return {"viewer": {"id": "viewer-1", "entity": "entity", "username": "tester", "email": "t@example.com",
                           "flags": "{}", "teams": {"edges": []}, "admin": False}}
    if "RunUploadUrls" in query:
        files = variables.get("files") or []
        return {"model": {"bucket": {"id": "bucket-1", "files": {"uploadHeaders": [], "edges": [
            {"node": {"name": f, "url": f"{base}/upload/{f}", "updatedAt": None}} for f in files]}}}}
    if "RunResumeStatus" in query or "bucket" in query:
        return {"model": {"id": "project-1", "name": "project", "entity": {"id": "entity-1", "name": "entity"},
                          "bucket": None}}
    if "project" in query:
        return {"model": {"id": "project-1", "name": "project", "entityName": "entity"}}
    return {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        record({"method": "GET", "path": self.path})
        self.reply(200, {})

    def do_PUT(self):
        raw = self.body()
        record({"method": "PUT", "path": self.path, "bytes": len(raw),
                "text": raw.decode("utf-8", "replace")[:20000]})
        self.reply(200, {})

    def do_POST(self):
        raw = self.body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"raw": raw.decode("utf-8", "replace")[:2000]}
        record({"method": "POST", "path": self.path, "body": body})
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path.startswith("/graphql"):
            self.reply(200, {"data": graphql(body, base)})
        elif re.search(r"/file_stream$", self.path):
            self.reply(200, {"exitcode": None, "limits": {}})
        else:
            self.reply(200, {})


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
