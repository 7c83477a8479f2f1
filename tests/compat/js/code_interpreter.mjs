// The stock @e2b/code-interpreter JS SDK against dsec's code-interpreter image (the SDK's
// default template, code-interpreter-v1): the data stack, a matplotlib figure as a PNG result,
// the javascript, bash and r kernels, and java refused (400).
import { Sandbox } from '@e2b/code-interpreter'
import { check, done } from './check.mjs'

const sbx = await Sandbox.create({ timeoutMs: 300_000 })
try {
  let ex = await sbx.runCode('import numpy as np, pandas as pd, sklearn, seaborn\nint(pd.Series(np.arange(5)).sum())')
  check(!ex.error && ex.text === '10', 'python data stack', ex.error ?? ex.text)
  ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()')
  const png = ex.results[0]?.png
  check(png && Buffer.from(png, 'base64').subarray(0, 4).toString('latin1') === '\x89PNG', 'matplotlib png', ex.results)
  ex = await sbx.runCode('1+1', { language: 'javascript' })
  check(ex.text === '2', 'javascript 1+1', ex.text)
  await sbx.runCode('const base = 40', { language: 'javascript' })
  ex = await sbx.runCode('base + 2', { language: 'javascript' })
  check(ex.text === '42', 'javascript state across cells', ex.text)
  const ctx = await sbx.createCodeContext({ language: 'javascript' })
  check(ctx.language === 'javascript', 'createCodeContext javascript', ctx)
  ex = await sbx.runCode('typeof base', { context: ctx })
  check(ex.text === "'undefined'", 'javascript context is separate', ex.text)
  ex = await sbx.runCode('echo $((6*7))', { language: 'bash' })
  check(ex.logs.stdout.join('') === '42\n', 'bash', ex.logs)
  ex = await sbx.runCode('1+1', { language: 'r' })       // IRkernel: display_data, not the main result
  check(ex.results[0]?.text === '[1] 2', 'r 1+1', ex.results)
  let refused = ''
  try { await sbx.runCode('System.out.println(1);', { language: 'java' }) } catch (e) { refused = String(e.message) }
  // (this SDK shows the body, which names the languages, only with diagnostics on)
  check(refused.startsWith('400'), 'java refused', refused)
} finally {
  await sbx.kill()
}
done()
