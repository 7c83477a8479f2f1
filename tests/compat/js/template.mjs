// The stock `e2b` JS SDK's Template against dsec: steps built into a template of the caller's
// project (apiserver/e2b/templates.py), then Sandbox.create(name) sees its files, env and workdir.
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Sandbox, Template } from 'e2b'
import { check, done } from './check.mjs'

const dir = mkdtempSync(join(tmpdir(), 'js-template-'))
writeFileSync(join(dir, 'local.txt'), 'from js\n')
const name = `js-tpl-${Math.random().toString(16).slice(2, 8)}`
const t = Template({ fileContextPath: dir })
  .fromImage('debian-python')
  .runCmd('echo hi > /hello')
  .copy('local.txt', '/app/local.txt')
  .setEnvs({ GREETING: 'hello js' })
  .setWorkdir('/app')
const logs = []
const info = await Template.build(t, name, { onBuildLogs: (e) => logs.push(e.message) })
check(info.templateId === name, 'Template.build', info)
check(await Template.exists(name), 'Template.exists (built)')
check(!(await Template.exists(`${name}-none`)), 'Template.exists (missing)')

const sbx = await Sandbox.create(name, { timeoutMs: 120_000 })
try {
  const r = await sbx.commands.run('cat /hello /app/local.txt; echo "$GREETING"; pwd')
  check(r.stdout === 'hi\nfrom js\nhello js\n/app\n', 'the sandbox of the template', r.stdout)
} finally {
  await sbx.kill()
}

let failed = null
try {
  await Template.build(Template({ fileContextPath: dir }).fromImage('debian-python').runCmd('echo js-boom; exit 3'),
    `${name}-fail`)
} catch (e) { failed = e }
check(failed && String(failed.message).includes('js-boom'), 'a failing RUN reports its log', String(failed))
done()
