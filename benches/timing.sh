# Timing helpers shared by the benches that run tools side by side (sourced, not run). Each run's
# wall time, CPU time (user + sys) and peak RSS come from /usr/bin/time -v and go, one line per run,
# to $WORK/results.txt.

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# measure LABEL CMD...: appends "label wall_s cpu_s maxrss_kb" to $WORK/results.txt
measure() {
  local label=$1; shift
  local log; log=$(mktemp)
  /usr/bin/time -v "$@" >/dev/null 2>"$log"
  local wall cpu rss
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; print s}' "$log")
  cpu=$(awk -F': ' '/User time/ {u=$2} /System time/ {s=$2} END {print u+s}' "$log")
  rss=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$log")
  echo "$label $wall $cpu $rss" | tee -a "$WORK/results.txt"
  rm -f "$log"
}

# summary LABEL: "wall cpu rss" medians of the runs labelled LABEL
summary() {
  local label=$1
  local w c r
  w=$(awk -v l="$label" '$1==l {print $2}' "$WORK/results.txt" | median)
  c=$(awk -v l="$label" '$1==l {print $3}' "$WORK/results.txt" | median)
  r=$(awk -v l="$label" '$1==l {print $4}' "$WORK/results.txt" | median)
  echo "$w $c $r"
}

# wall_and_anon CMD...: prints "<wall seconds> <peak RssAnon kB>". RssAnon is sampled from /proc
# every 10 ms: the memory the tool allocates, without the file-backed pages of mmap'd inputs that
# /usr/bin/time's maximum RSS also counts.
wall_and_anon() {
  local t0 t1 pid peak=0 v
  t0=$(date +%s.%N)
  "$@" >/dev/null 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    v=$(awk '/^RssAnon:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    if [ -n "$v" ] && [ "$v" -gt "$peak" ]; then peak=$v; fi
    sleep 0.01
  done
  wait "$pid"
  t1=$(date +%s.%N)
  echo "$(echo "$t1 - $t0" | bc -l) $peak"
}

# median_words: the median of the space-separated numbers on standard input
median_words() { tr ' ' '\n' | grep -v '^$' | median; }
