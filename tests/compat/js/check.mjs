// Tiny assertion helpers shared by the JS compat scripts: a failed check prints what was seen
// and exits non-zero, so tests/compat/test_js_sdk.py reports it.
export function check(ok, what, seen) {
  if (!ok) {
    console.error(`FAILED: ${what}` + (seen === undefined ? '' : `: ${JSON.stringify(seen)}`))
    process.exit(1)
  }
}
export function done() { console.log('OK'); process.exit(0) }
