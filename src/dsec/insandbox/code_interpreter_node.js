// dsec's JavaScript cell runner (node), driven by code_interpreter_kernels.py.
// One cell per stdin line ({"code": str}); every cell runs in this process's realm, so
// top-level let/const/var, functions and required modules stay across cells. The end of a
// cell goes to fd $DSEC_CTL_FD as one JSON line: {"value": util.inspect(last value) | null}
// or {"error": {name, value, traceback}}. A Promise value is awaited first (E2B's JS kernel
// allows `await`-style cells). SIGINT stops a running cell (breakOnSigint) or an awaited one.
'use strict';
const fs = require('fs');
const readline = require('readline');
const util = require('util');
const vm = require('vm');
const path = require('path');
const Module = require('module');

const ctlFd = Number(process.env.DSEC_CTL_FD);
delete process.env.DSEC_CTL_FD;
// require() as a REPL has it: relative to the working directory, then the global paths
global.require = Module.createRequire(path.join(process.cwd(), '<cell>'));
global.module = { exports: {} };

let waiting = null;   // the reject of an awaited cell, for SIGINT
process.on('SIGINT', () => { if (waiting) waiting(new Error('interrupted')); });

function end(msg) { fs.writeSync(ctlFd, JSON.stringify(msg) + '\n'); }

// the user's frames only: this runner's and vm's are noise
function userStack(stack) {
  const lines = String(stack).split('\n');
  const cut = lines.findIndex((l) => l.includes(__filename) || l.includes('node:vm'));
  return (cut > 0 ? lines.slice(0, cut) : lines).join('\n');
}

function fail(e) {
  if (e instanceof Error || (e && typeof e === 'object' && 'stack' in e)) {
    end({ error: { name: e.name || 'Error', value: String(e.message || ''), traceback: userStack(e.stack || e) } });
  } else {
    end({ error: { name: 'Error', value: util.inspect(e), traceback: 'Uncaught ' + util.inspect(e) } });
  }
}

function show(value) { return value === undefined ? null : util.inspect(value); }

async function runCell(code) {
  let value;
  try {
    const script = new vm.Script(code, { filename: 'cell.js' });
    value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  } catch (e) {
    // `await` at the top level: an async function of the cell, as one expression (its value
    // comes back) or else as a body (names declared there stay local to the cell)
    if (e instanceof SyntaxError && /await/.test(String(e.message)) && /\bawait\b/.test(code)) {
      let script;
      try { script = new vm.Script('(async () => (\n' + code + '\n))()', { filename: 'cell.js' }); }
      catch (e1) {
        try { script = new vm.Script('(async () => {\n' + code + '\n})()', { filename: 'cell.js' }); }
        catch (e2) { fail(e2); return; }
      }
      try { value = script.runInThisContext({ breakOnSigint: true, displayErrors: false }); }
      catch (e3) { fail(e3); return; }
    } else { fail(e); return; }
  }
  if (value && typeof value.then === 'function') {
    try {
      value = await new Promise((resolve, reject) => { waiting = reject; value.then(resolve, reject); });
    } catch (e) { waiting = null; fail(e); return; }
    waiting = null;
  }
  try { end({ value: show(value) }); } catch (e) { fail(e); }
}

// cells run one at a time, in order
let chain = Promise.resolve();
const rl = readline.createInterface({ input: process.stdin, terminal: false });
rl.on('line', (line) => {
  let msg;
  try { msg = JSON.parse(line); } catch (e) { return; }
  chain = chain.then(() => runCell(String(msg.code)));
});
rl.on('close', () => process.exit(0));
// an error thrown later by a timer or a callback is printed, not fatal to the state
process.on('uncaughtException', (e) => { process.stderr.write('Uncaught ' + (e && e.stack || e) + '\n'); });
process.on('unhandledRejection', (e) => { process.stderr.write('Unhandled rejection ' + (e && e.stack || e) + '\n'); });
