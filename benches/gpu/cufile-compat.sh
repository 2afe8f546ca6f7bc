# Sourced by the GPU machine's scripts: lets cuFile run in compatibility mode on a machine without
# nvidia-fs (this one): a copy of /etc/cufile.json with allow_compat_mode, named by
# CUFILE_ENV_PATH_JSON, and a udev record for the block device holding $WORK (cuFile looks the file
# system up there). Needs WORK and OUT set.
# cuFile config: allow compatibility mode (no nvidia-fs here).
python3 - "$WORK/cufile.json" <<'PY'
import re, sys, os
src = "/etc/cufile.json"
text = open(src).read() if os.path.exists(src) else '{\n  "properties": {\n  }\n}\n'
if re.search(r'^\s*"allow_compat_mode"', text, re.M):
    text = re.sub(r'^(\s*"allow_compat_mode"\s*:\s*)(true|false)', r'\1true', text, flags=re.M)
else:
    text = re.sub(r'("properties"\s*:\s*\{)', r'\1\n    "allow_compat_mode": true,', text, count=1)
    text = re.sub(r',(\s*\})', r'\1', text)  # a trailing comma if properties was empty
open(sys.argv[1], "w").write(text)
print("cufile.json from", src if os.path.exists(src) else "scratch")
PY
export CUFILE_ENV_PATH_JSON="$WORK/cufile.json"
export CUFILE_LOGFILE_PATH="$OUT/cufile.log"
grep -n '"allow_compat_mode"' "$CUFILE_ENV_PATH_JSON"

# udev record for the block device holding $WORK (cuFile looks its file system up there).
MAJMIN=$(stat -c '%Hd:%Ld' "$WORK")
mkdir -p /run/udev/data
printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=ext4\n' > "/run/udev/data/b$MAJMIN"
echo "udev record: /run/udev/data/b$MAJMIN"
