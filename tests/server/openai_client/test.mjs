// moat serve end to end with the official `openai` npm package, unmodified (issue 11, "Tests").
// Usage: node test.mjs BASE_URL API_KEY [MODEL]   (BASE_URL like http://127.0.0.1:8000/v1)
// run.sh starts the server on models/k3-nano and runs this. Exit status 0 only if every check passes.
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { VERSION } from 'openai/version';

const [baseURL, apiKey, model = 'k3-nano'] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error('usage: node test.mjs BASE_URL API_KEY [MODEL]');
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120_000 });

const checks = [];
const check = (name, fn) => checks.push({ name, fn });

async function collectCompletion(params) {
  const stream = await client.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, 'text_completion');
    for (const c of chunk.choices) {
      text += c.text ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  return { text, finish, usage, chunks };
}

function assertUsage(usage, completionTokens) {
  assert.ok(usage, 'usage present');
  assert.ok(usage.prompt_tokens > 0, `prompt_tokens ${usage.prompt_tokens}`);
  if (completionTokens !== undefined) assert.equal(usage.completion_tokens, completionTokens);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
}

check('models.list names the model', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.ok(ids.length >= 1, 'at least one model');
  // The directory's name is always accepted; the listed id is the served name.
  const r = await client.completions.create({ model: ids[0], prompt: 'Hi', max_tokens: 1, temperature: 0 });
  assert.equal(r.choices.length, 1);
});

check('completion, not streaming: text, usage, finish_reason', async () => {
  const r = await client.completions.create({
    model, prompt: 'A computer is', max_tokens: 12, temperature: 0, ignore_eos: true,
  });
  assert.equal(r.object, 'text_completion');
  assert.match(r.id, /^cmpl-/);
  assert.equal(r.choices.length, 1);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.ok(r.choices[0].text.length > 0);
  assert.equal(r.choices[0].finish_reason, 'length');
  assertUsage(r.usage, 12);
});

check('completion, streaming equals not streaming at temperature 0, with usage', async () => {
  const params = { model, prompt: 'The meaning of life is', max_tokens: 16, temperature: 0, ignore_eos: true };
  const whole = await client.completions.create(params);
  const s = await collectCompletion(params);
  assert.equal(s.text, whole.choices[0].text);
  assert.equal(s.finish, 'length');
  assert.ok(s.chunks >= 2, `chunks ${s.chunks}`);
  assertUsage(s.usage, 16);
  assert.deepEqual(s.usage, whole.usage);
});

check('chat, not streaming and streaming agree; usage', async () => {
  const params = {
    model, messages: [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hello, who are you?' }],
    max_tokens: 16, temperature: 0, ignore_eos: true,
  };
  const r = await client.chat.completions.create(params);
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.equal(r.choices[0].finish_reason, 'length');
  assertUsage(r.usage, 16);

  const stream = await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let content = '';
  let role = null;
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      content += c.delta.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(role, 'assistant');
  assert.equal(content, r.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, r.usage);
});

check('stop: the text ends before the stop string, finish_reason "stop"', async () => {
  const params = { model, prompt: 'Once upon a time', max_tokens: 24, temperature: 0, ignore_eos: true };
  const full = (await client.completions.create(params)).choices[0].text;
  assert.ok(full.length >= 6, `greedy text too short to cut: ${JSON.stringify(full)}`);
  const stop = full.slice(3, 6);
  const cut = full.slice(0, full.indexOf(stop));
  const r = await client.completions.create({ ...params, stop: [stop] });
  assert.equal(r.choices[0].text, cut);
  assert.equal(r.choices[0].finish_reason, 'stop');
  const s = await collectCompletion({ ...params, stop });
  assert.equal(s.text, cut);
  assert.equal(s.finish, 'stop');
  const chat = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 24, temperature: 0, ignore_eos: true,
  });
  const chatFull = chat.choices[0].message.content;
  if (chatFull.length >= 6) {
    const chatStop = chatFull.slice(3, 6);
    const c2 = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 24, temperature: 0, ignore_eos: true,
      stop: chatStop,
    });
    assert.equal(c2.choices[0].message.content, chatFull.slice(0, chatFull.indexOf(chatStop)));
    assert.equal(c2.choices[0].finish_reason, 'stop');
  }
});

check('n=2 gives two choices (completions and chat)', async () => {
  const r = await client.completions.create({
    model, prompt: 'Once upon a time', max_tokens: 8, temperature: 1, seed: 7, n: 2, ignore_eos: true,
  });
  assert.equal(r.choices.length, 2);
  assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
  assertUsage(r.usage, 16);
  const c = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 8, temperature: 1, seed: 7, n: 2, ignore_eos: true,
  });
  assert.equal(c.choices.length, 2);
  assert.deepEqual(c.choices.map((x) => x.index).sort(), [0, 1]);
  // Streaming n=2: both indexes appear.
  const stream = await client.completions.create({
    model, prompt: 'Never', max_tokens: 6, temperature: 1, seed: 7, n: 2, stream: true, ignore_eos: true,
  });
  const seen = new Set();
  for await (const chunk of stream) for (const ch of chunk.choices) seen.add(ch.index);
  assert.deepEqual([...seen].sort(), [0, 1]);
});

check('logprobs (completions: logprobs=N; chat: logprobs + top_logprobs)', async () => {
  const r = await client.completions.create({
    model, prompt: 'A computer is', max_tokens: 5, temperature: 0, logprobs: 3, ignore_eos: true,
  });
  const lp = r.choices[0].logprobs;
  assert.ok(lp, 'logprobs present');
  assert.equal(lp.tokens.length, 5);
  assert.equal(lp.token_logprobs.length, 5);
  assert.equal(lp.top_logprobs.length, 5);
  assert.equal(lp.text_offset.length, 5);
  for (const v of lp.token_logprobs) assert.ok(v <= 0 && Number.isFinite(v), `logprob ${v}`);
  for (const top of lp.top_logprobs) assert.ok(Object.keys(top).length >= 1 && Object.keys(top).length <= 4);
  assert.equal(lp.tokens.join(''), r.choices[0].text);

  const c = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2,
    ignore_eos: true,
  });
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, 4);
  for (const t of content) {
    assert.equal(typeof t.token, 'string');
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs.length, 2);
  }
});

check('seed reproduces sampling', async () => {
  const params = { model, prompt: 'Once upon a time', max_tokens: 16, temperature: 1.0, top_p: 0.95, seed: 1234, ignore_eos: true };
  const a = await client.completions.create(params);
  const b = await client.completions.create(params);
  assert.equal(a.choices[0].text, b.choices[0].text);
  const chatParams = { model, messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 16, temperature: 1.0, seed: 99 };
  const c1 = await client.chat.completions.create(chatParams);
  const c2 = await client.chat.completions.create(chatParams);
  assert.equal(c1.choices[0].message.content, c2.choices[0].message.content);
});

async function expectError(promise, Cls, status, what) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof Cls, `${what}: expected ${Cls.name}, got ${e?.constructor?.name}: ${e?.message}`);
    assert.equal(e.status, status, `${what}: status`);
    assert.ok(typeof e.message === 'string' && e.message.length > 0, `${what}: a message`);
    return e;
  }
  assert.fail(`${what}: no error`);
}

check('a bad parameter is a BadRequestError (400)', async () => {
  await expectError(client.completions.create({ model, prompt: 'Hi', max_tokens: 4, temperature: -1 }),
    OpenAI.BadRequestError, 400, 'temperature -1');
  await expectError(client.completions.create({ model, prompt: 'Hi', max_tokens: 4, best_of: 2 }),
    OpenAI.BadRequestError, 400, 'best_of');
  await expectError(client.chat.completions.create({ model, messages: [], max_tokens: 4 }),
    OpenAI.BadRequestError, 400, 'empty messages');
});

check('a wrong API key is an AuthenticationError (401)', async () => {
  const bad = new OpenAI({ baseURL, apiKey: apiKey + '-wrong', maxRetries: 0 });
  await expectError(bad.completions.create({ model, prompt: 'Hi', max_tokens: 1 }), OpenAI.AuthenticationError, 401, 'wrong key');
  await expectError(bad.models.list(), OpenAI.AuthenticationError, 401, 'wrong key, models');
});

check('an unknown model is a NotFoundError (404)', async () => {
  await expectError(client.completions.create({ model: 'no-such-model', prompt: 'Hi', max_tokens: 1 }),
    OpenAI.NotFoundError, 404, 'unknown model');
  await expectError(client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'Hi' }] }),
    OpenAI.NotFoundError, 404, 'unknown model, chat');
});

let failed = 0;
for (const { name, fn } of checks) {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}\n     ${(e && e.stack) || e}`);
  }
}
console.log(`${checks.length - failed}/${checks.length} checks passed (openai ${VERSION})`);
process.exit(failed ? 1 : 0);
