#!/bin/bash
# First start of a fresh clone: time `make serve` from `git clone` to /health and to the README
# demo's answer, with an empty VTOKEN_HOME. Writes benchmarks/results/first_start.json.
#   bash benchmarks/first_start.sh [PORT]
# Needs network (pip, the asset wheels) and ~4 GB of disk under /tmp; removes its clone at the end.
set -u
PORT=${1:-8124}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/vtoken_first_start.XXXXXX)
OUT="$REPO/benchmarks/results/first_start.json"
git clone -q "$REPO" "$WORK/clone"
cd "$WORK/clone" || exit 1
export VTOKEN_HOME="$WORK/home"
unset PYTHONPATH
t0=$(date +%s.%N)
setsid make serve PORT="$PORT" > "$WORK/make_serve.log" 2>&1 &
pid=$!
inst=null; assets=null; healthy=null
for _ in $(seq 1 3600); do
  now=$(date +%s.%N)
  [ "$inst" = null ] && [ -f .venv/.installed ] && inst=$(echo "$now - $t0" | bc)
  [ "$assets" = null ] && grep -q "^\[2/2\] sharegpt: /" "$WORK/make_serve.log" && assets=$(echo "$now - $t0" | bc)
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then healthy=$(echo "$now - $t0" | bc); break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
.venv/bin/python -c 'import json; from vtoken.assets.paths import sharegpt_path
conv = next(c for c in json.load(open(sharegpt_path())) if c["id"] == "nsrVEnT_0")
print(json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": conv["conversations"][0]["value"]}],
                  "max_tokens": 128, "temperature": 0}))' > "$WORK/req.json"
usage=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d @"$WORK/req.json" \
        | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["usage"]))' 2>/dev/null || echo null)
answered=$(echo "$(date +%s.%N) - $t0" | bc)
kill -INT -- -$pid 2>/dev/null; sleep 10; kill -KILL -- -$pid 2>/dev/null
smollm2_s=$(grep -o "^\[1/2\] smollm2: /.*(\([0-9.]*\) s)" "$WORK/make_serve.log" | grep -o "([0-9.]* s)" | tr -d '( s)')
sharegpt_s=$(grep -o "^\[2/2\] sharegpt: /.*(\([0-9.]*\) s)" "$WORK/make_serve.log" | grep -o "([0-9.]* s)" | tr -d '( s)')
python3 - "$OUT" <<PY
import json, os, platform, sys, time
f = lambda x: None if x in ("null", "") else round(float(x), 1)
json.dump(dict(command="bash benchmarks/first_start.sh", date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               commit="$(git rev-parse HEAD)", machine=dict(platform=platform.platform(), cpu_count=os.cpu_count()),
               pip_find_links=os.environ.get("PIP_FIND_LINKS"),
               seconds_from_make_serve=dict(venv_installed=f("$inst"), assets_built=f("$assets"),
                                            health_ok=f("$healthy"), demo_answered=f("$answered")),
               asset_steps_s=dict(smollm2=f("$smollm2_s"), sharegpt=f("$sharegpt_s")),
               demo_usage=json.loads('$usage') if '$usage' != 'null' else None),
          open(sys.argv[1], "w"), indent=1)
print(open(sys.argv[1]).read())
PY
rm -rf "$WORK"
