# Sourced by the device scripts: install the carried wheels (the daemon's dependencies,
# py-spy) from .whl into /tmp/site once per machine, put them on PYTHONPATH and PATH
# beside the repository, and cd to it. Needs $repo and $py set.
if ls "$repo"/.whl/*.whl >/dev/null 2>&1 && [ ! -e /tmp/site/.installed ]; then
  timeout 300 $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$repo"/.whl/*.whl && touch /tmp/site/.installed
fi
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
cd "$repo" || exit 1
