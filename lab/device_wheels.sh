# Sourced by the lab/gpu_session*.sh scripts: installs the carried wheels (.whl: what the device image lacks, for
# its own python, chosen by name) into /tmp/site once per machine; a later script on the same machine skips it.
if [ -d .whl ] && [ ! -e /tmp/site/.ninfer-wheels ]; then
  if python3 -m pip install -q --no-index --no-deps --target /tmp/site --find-links .whl \
       $(ls .whl | sed 's/-[0-9].*//' | sort -u) > /tmp/wheels.log 2>&1; then
    touch /tmp/site/.ninfer-wheels
  fi
  grep -v 'already exists' /tmp/wheels.log | tail -2
fi
